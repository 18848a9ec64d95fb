"""Client partitions of a labelled set: one class per client, or Dirichlet label skew; trimming."""

from __future__ import annotations

import numpy as np

from .mnist import MnistData


def _trim_equal(parts: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """Cut every part to the smallest part's size, keeping a seeded random subset."""
    k = min(len(p) for p in parts)
    out = []
    for p in parts:
        if len(p) > k:
            p = rng.permutation(p)[:k]
        out.append(np.sort(p))
    return out


class PartitionError(ValueError):
    """The data cannot be split as asked (too many clients for the examples): a setting that is
    infeasible, refused before the run starts."""


def _one_class_each(by_class: list[np.ndarray], num_clients: int, min_size: int,
                    rng: np.random.Generator) -> list[np.ndarray]:
    """``alpha == 0``: client i gets class i; clients sharing a class split it after a shuffle."""
    C = len(by_class)
    if num_clients <= C:
        parts = [by_class[i] for i in range(num_clients)]
    else:
        parts = [np.empty(0, dtype=np.int64)] * num_clients
        for c in range(C):
            owners = list(range(c, num_clients, C))
            shuffled = rng.permutation(by_class[c])
            for owner, chunk in zip(owners, np.array_split(shuffled, len(owners))):
                parts[owner] = np.sort(chunk)
    sizes = [len(p) for p in parts]
    if min(sizes) < min_size:
        raise PartitionError(f"{num_clients} clients: the alpha=0 partition (one class per client) of "
                             f"{sum(len(c) for c in by_class)} examples leaves a client with {min(sizes)} < "
                             f"{min_size}; use fewer clients (or the quadratic task for a larger population)")
    return parts


def _dirichlet(by_class: list[np.ndarray], num_clients: int, alpha: float, min_size: int,
               rng: np.random.Generator, num_examples: int) -> list[np.ndarray]:
    """``alpha > 0``: per class, proportions ~ Dirichlet(alpha·1), redrawn until every client has
    at least ``min_size`` examples (at most 1000 draws)."""
    for _attempt in range(1000):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            p = rng.dirichlet(np.full(num_clients, alpha))
            shuffled = rng.permutation(idx)
            cuts = (np.cumsum(p)[:-1] * len(shuffled)).astype(np.int64)
            for client, chunk in enumerate(np.split(shuffled, cuts)):
                buckets[client].append(chunk)
        parts = [np.sort(np.concatenate(b)).astype(np.int64) for b in buckets]
        if min(len(p) for p in parts) >= min_size:
            return parts
    raise PartitionError(
        f"no Dirichlet(alpha={alpha}) partition with >= {min_size} examples per client "
        f"after 1000 draws ({num_examples} examples, {num_clients} clients)"
    )


def partition_labels(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int,
    *,
    trim: bool = True,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Split example indices among ``num_clients`` by label.

    ``alpha == 0``: one class per client (client ``i`` gets class ``i`` of the
    sorted class list; with more clients than classes, the clients sharing
    class ``i % C`` split it into equal contiguous chunks after a seeded
    shuffle).  ``alpha > 0``: per class, proportions ~ Dirichlet(alpha·1),
    redrawn until every client has at least ``min_size`` examples.  With
    ``trim`` all clients are cut to the smallest client's size.  Returns
    sorted int64 index arrays; identical inputs and seed give identical output.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-d, got shape {labels.shape}")
    if int(num_clients) != num_clients or num_clients < 1:
        raise ValueError(f"num_clients must be a positive integer, got {num_clients}")
    num_clients = int(num_clients)
    alpha = float(alpha)
    if not np.isfinite(alpha) or alpha < 0:
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    if classes.size == 0:
        raise ValueError("labels is empty")
    by_class = [np.flatnonzero(labels == c).astype(np.int64) for c in classes]

    if alpha == 0:
        parts = _one_class_each(by_class, num_clients, min_size, rng)
    else:
        parts = _dirichlet(by_class, num_clients, alpha, min_size, rng, len(labels))
    if trim:
        parts = _trim_equal(parts, rng)
    return [np.asarray(p, dtype=np.int64) for p in parts]


def partition_mnist(
    data: MnistData, num_clients: int, alpha: float, seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Partition the training set; returns (uint8 images, int64 labels) per client."""
    parts = partition_labels(data.train_y, num_clients, alpha, seed)
    return [(data.train_x[idx], data.train_y[idx]) for idx in parts]
