"""The model, the data and the training loop, in numpy: nothing asynchronous in here.

The model is a softmax (multinomial logistic) regression with two arrays, ``weight`` (features ×
classes) and ``bias``. The data are Gaussian clusters, one per class, generated from fixed seeds:
every process gives partition i the same examples, and the server has its own held-out set.
Partitions are label-skewed: half of partition i's examples belong to class i mod ``CLASSES``.
"""

from __future__ import annotations

import functools

import numpy as np
from flwr.app import Array, ArrayRecord

FEATURES = 8
CLASSES = 4
#: Fixes the class centres, so that every partition and the server's test set share them.
CENTRES_SEED = 7
#: How far the clusters overlap (the noise around each centre); the best accuracy is well below 1.
SPREAD = 1.6


def initial_arrays(seed: int = 0) -> ArrayRecord:
    """A small random model, in the layout every job carries and every reply returns."""
    rng = np.random.default_rng(seed)
    weight = (0.01 * rng.standard_normal((FEATURES, CLASSES))).astype(np.float32)
    return ArrayRecord({"weight": Array(weight), "bias": Array(np.zeros(CLASSES, np.float32))})


def to_arrays(weight: np.ndarray, bias: np.ndarray) -> ArrayRecord:
    return ArrayRecord({"weight": Array(weight.astype(np.float32)), "bias": Array(bias.astype(np.float32))})


def from_arrays(arrays: ArrayRecord) -> tuple[np.ndarray, np.ndarray]:
    return arrays["weight"].numpy(), arrays["bias"].numpy()


@functools.lru_cache(maxsize=1)
def _centres() -> np.ndarray:
    return np.random.default_rng(CENTRES_SEED).normal(scale=1.5, size=(CLASSES, FEATURES))


def _sample(rng: np.random.Generator, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = _centres()[labels] + SPREAD * rng.standard_normal((len(labels), FEATURES))
    return x.astype(np.float32), labels.astype(np.int64)


@functools.lru_cache(maxsize=64)
def load_data(partition_id: int, examples: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Partition ``partition_id``'s (training, validation) examples, 80/20, built once per process."""
    if partition_id < 0 or examples < 5:
        raise ValueError(f"partition {partition_id} with {examples} examples: need an id ≥ 0 and ≥ 5 examples")
    rng = np.random.default_rng(1000 + partition_id)
    labels = np.where(rng.random(examples) < 0.5, partition_id % CLASSES, rng.integers(0, CLASSES, examples))
    x, y = _sample(rng, labels)
    cut = int(0.8 * examples)
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


@functools.lru_cache(maxsize=4)
def test_set(examples: int) -> tuple[np.ndarray, np.ndarray]:
    """The server's held-out examples, balanced over the classes."""
    rng = np.random.default_rng(99)
    return _sample(rng, np.arange(examples) % CLASSES)


def _probabilities(weight: np.ndarray, bias: np.ndarray, x: np.ndarray) -> np.ndarray:
    logits = x @ weight + bias
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(axis=1, keepdims=True)


def train(weight: np.ndarray, bias: np.ndarray, data: tuple[np.ndarray, np.ndarray], *, lr: float, epochs: int,
          batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Local minibatch SGD on the cross-entropy; returns the trained (weight, bias) and the mean
    training loss over the minibatches."""
    x, y = data
    weight, bias = weight.astype(np.float64), bias.astype(np.float64)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for start in range(0, len(x), batch_size):
            idx = order[start:start + batch_size]
            p = _probabilities(weight, bias, x[idx])
            losses.append(float(-np.log(p[np.arange(len(idx)), y[idx]] + 1e-12).mean()))
            p[np.arange(len(idx)), y[idx]] -= 1.0  # the gradient of the loss in the logits
            weight -= lr * (x[idx].T @ p) / len(idx)
            bias -= lr * p.mean(axis=0)
    return weight, bias, float(np.mean(losses))


def evaluate(weight: np.ndarray, bias: np.ndarray, data: tuple[np.ndarray, np.ndarray]) -> tuple[float, float]:
    """Mean cross-entropy and accuracy on ``data``."""
    x, y = data
    p = _probabilities(weight.astype(np.float64), bias.astype(np.float64), x)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
    return loss, float((p.argmax(axis=1) == y).mean())
