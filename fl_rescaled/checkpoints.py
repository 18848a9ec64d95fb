"""Checkpoints: a run's final model and its summary; a run's whole state, to resume it.

A final-model checkpoint is two files with one stem: ``<stem>.npz`` (the flat model,
``allow_pickle`` never needed) and ``<stem>.json`` (the run's outcome without its history).
``load_checkpoint`` refuses a model whose size does not match the summary.

A run-state checkpoint (``write_state``/``read_state``) is one file: a JSON header line (format,
the run's fingerprint, the payload's length and sha256) and the pickled state. It is written
atomically, so a run killed while writing leaves the previous checkpoint intact. Reading checks,
before anything is unpickled, that the file is whole (length, checksum) and that it belongs to
this run (fingerprint), and then unpickles with an allowlist of modules (this package, numpy,
Flower's records, a few builtins): a corrupted or foreign checkpoint is refused with a one-line
``CheckpointError``, never half-loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np


def _file_mode() -> int:
    """0o666 minus the process umask (read once, at import, before any thread could race on it)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


_FILE_MODE = _file_mode()


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``path``; on success it replaces ``path`` in one step.

    Readers never see a half-written file, and a failure leaves ``path`` as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _FILE_MODE)  # mkstemp's file is private (0600); a plain open() would obey the umask
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_checkpoint(stem: str | Path, params: np.ndarray, summary: dict[str, Any]) -> tuple[Path, Path]:
    stem = Path(stem)
    model_path, meta_path = stem.with_suffix(".npz"), stem.with_suffix(".json")
    flat = np.ascontiguousarray(params).reshape(-1)
    meta = {k: v for k, v in summary.items() if k not in ("history", "final_model")}
    meta["model_size"] = int(flat.size)
    meta["model_dtype"] = str(flat.dtype)
    with atomic_path(model_path) as tmp, tmp.open("wb") as fh:
        np.savez(fh, model=flat)
    with atomic_path(meta_path) as tmp:
        tmp.write_text(json.dumps(meta, default=float, indent=1))
    return model_path, meta_path


def load_checkpoint(stem: str | Path) -> tuple[np.ndarray, dict[str, Any]]:
    stem = Path(stem)
    meta = json.loads(stem.with_suffix(".json").read_text())
    with np.load(stem.with_suffix(".npz"), allow_pickle=False) as z:
        model = z["model"]
    if model.ndim != 1 or model.size != int(meta["model_size"]):
        raise ValueError(f"checkpoint {stem}: model of size {model.size}, summary says {meta['model_size']}")
    return model, meta


STATE_FORMAT = 1
_MAGIC = b"fl-rescaled run state\n"


class CheckpointError(ValueError):
    """A run-state checkpoint that cannot be used (missing, corrupted, foreign); one line."""


_ALLOWED_MODULES = ("fl_rescaled.", "numpy", "flwr.app.", "collections", "copyreg", "_codecs", "functools",
                    "_operator", "operator")
_ALLOWED_BUILTINS = {"set", "frozenset", "dict", "list", "tuple", "int", "float", "complex", "bool", "str",
                     "bytes", "bytearray", "slice", "range", "object", "getattr"}


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "builtins" and name in _ALLOWED_BUILTINS:
            return super().find_class(module, name)
        if module.startswith(_ALLOWED_MODULES) or module == "fl_rescaled":
            return super().find_class(module, name)
        raise CheckpointError(f"the checkpoint refers to {module}.{name}, which a run state never contains")


def write_state(path: str | Path, state: Any, fingerprint: str) -> Path:
    """Write ``state`` (pickled) with a header naming ``fingerprint``; atomically."""
    payload = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    header = {"format": STATE_FORMAT, "fingerprint": fingerprint, "bytes": len(payload),
              "sha256": hashlib.sha256(payload).hexdigest(), "written": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = Path(path)
    with atomic_path(path) as tmp, tmp.open("wb") as fh:
        fh.write(_MAGIC + json.dumps(header).encode() + b"\n")
        fh.write(payload)
        fh.flush()
        os.fsync(fh.fileno())
    return path


def read_state(path: str | Path, fingerprint: str) -> Any:
    """The state written by ``write_state`` for the run ``fingerprint``; ``CheckpointError`` otherwise."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    blob = path.read_bytes()
    if not blob.startswith(_MAGIC):
        raise CheckpointError(f"{path} is not an fl-rescaled run checkpoint")
    line, sep, payload = blob[len(_MAGIC):].partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError:
        header = None
    if not sep or not isinstance(header, dict):
        raise CheckpointError(f"{path}: the checkpoint's header is damaged")
    if header.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {header.get('format')!r}, this version reads {STATE_FORMAT}")
    if len(payload) != header.get("bytes") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise CheckpointError(f"{path}: the checkpoint is corrupted (its length or checksum does not match)")
    if header.get("fingerprint") != fingerprint:
        raise CheckpointError(f"{path}: the checkpoint belongs to another run (other settings, strategy or model)")
    try:
        return _StateUnpickler(io.BytesIO(payload)).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever is wrong inside, nothing was loaded
        raise CheckpointError(f"{path}: the checkpoint cannot be read ({type(exc).__name__}: {exc})") from None
