"""The MNIST container, its standard sizes and the structural checks every source applies."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081

#: Number of training images per digit 0..9 in the standard 60,000-image set.
MNIST_TRAIN_CLASS_COUNTS = (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949)
MNIST_TRAIN_SIZE = 60000
MNIST_TEST_SIZE = 10000

#: The four arrays of an MNIST set and the standard names of their IDX files.
IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


@dataclass
class MnistData:
    """MNIST as flat uint8 pixel rows and int64 labels."""

    train_x: np.ndarray  # uint8, (60000, 784)
    train_y: np.ndarray  # int64, (60000,)
    test_x: np.ndarray  # uint8, (10000, 784)
    test_y: np.ndarray  # int64, (10000,)
    source: str  # which source supplied the arrays (for logs/reports)


def normalize(x_uint8: np.ndarray) -> np.ndarray:
    """Scale uint8 pixels to [0, 1] and standardise with the MNIST mean/std (float32)."""
    x = np.asarray(x_uint8, dtype=np.float32) / np.float32(255.0)
    return (x - np.float32(MNIST_MEAN)) / np.float32(MNIST_STD)


def check_arrays(
    train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray, where: str
) -> None:
    """Structural checks shared by every source (sizes need not be the full 60k/10k)."""
    for name, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
        if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 784:
            raise ValueError(f"{where}: {name} images must be uint8 (N, 784), got {x.dtype} {x.shape}")
        if y.dtype != np.int64 or y.ndim != 1:
            raise ValueError(f"{where}: {name} labels must be int64 (N,), got {y.dtype} {y.shape}")
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"{where}: {x.shape[0]} {name} images but {y.shape[0]} labels")
        if y.size and (y.min() < 0 or y.max() > 9):
            raise ValueError(f"{where}: {name} labels outside 0..9")


def check_full_mnist(data: MnistData) -> None:
    """What every source must deliver: the structural checks, the exact standard sizes (60,000
    training and 10,000 test images) and the standard training class counts."""
    check_arrays(data.train_x, data.train_y, data.test_x, data.test_y, data.source)
    if data.train_x.shape != (MNIST_TRAIN_SIZE, 784) or data.test_x.shape != (MNIST_TEST_SIZE, 784):
        raise ValueError(f"{data.source}: expected {MNIST_TRAIN_SIZE}/{MNIST_TEST_SIZE} images, "
                         f"got {data.train_x.shape[0]}/{data.test_x.shape[0]}")
    counts = tuple(int(c) for c in np.bincount(data.train_y, minlength=10))
    if counts != MNIST_TRAIN_CLASS_COUNTS:
        raise ValueError(f"{data.source}: training class counts {counts}, not MNIST's {MNIST_TRAIN_CLASS_COUNTS}")
