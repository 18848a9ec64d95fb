"""Checkpoints: a run's final model and its summary, written atomically and read back.

A checkpoint is two files with one stem: ``<stem>.npz`` (the flat model, ``allow_pickle`` never
needed) and ``<stem>.json`` (the run's outcome without its history). ``load_checkpoint`` refuses
a model whose size does not match the summary.
"""

from __future__ import annotations

import json
import os
import tempfile
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
