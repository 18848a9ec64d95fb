"""Checkpoints: a run's final model and its summary, written atomically and read back.

A checkpoint is two files with one stem: ``<stem>.npz`` (the flat model, ``allow_pickle`` never
needed) and ``<stem>.json`` (the run's outcome without its history). ``load_checkpoint`` refuses
a model whose size does not match the summary.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_checkpoint(stem: str | Path, params: np.ndarray, summary: dict[str, Any]) -> tuple[Path, Path]:
    stem = Path(stem)
    model_path, meta_path = stem.with_suffix(".npz"), stem.with_suffix(".json")
    flat = np.ascontiguousarray(params).reshape(-1)
    meta = {k: v for k, v in summary.items() if k not in ("history", "final_model")}
    meta["model_size"] = int(flat.size)
    meta["model_dtype"] = str(flat.dtype)
    _atomic_write(model_path, lambda fh: np.savez(fh, model=flat))
    _atomic_write(meta_path, lambda fh: fh.write(json.dumps(meta, default=float, indent=1).encode()))
    return model_path, meta_path


def load_checkpoint(stem: str | Path) -> tuple[np.ndarray, dict[str, Any]]:
    stem = Path(stem)
    meta = json.loads(stem.with_suffix(".json").read_text())
    with np.load(stem.with_suffix(".npz"), allow_pickle=False) as z:
        model = z["model"]
    if model.ndim != 1 or model.size != int(meta["model_size"]):
        raise ValueError(f"checkpoint {stem}: model of size {model.size}, summary says {meta['model_size']}")
    return model, meta
