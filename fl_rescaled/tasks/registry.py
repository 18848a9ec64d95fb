"""Tasks from their config: the canonical spec text every job carries, and a per-process cache."""

from __future__ import annotations

import json
import threading
from typing import Any

from .base import TASK_KEYS, TASKS
from .mnist import MnistTask
from .quadratic import QuadraticTask
from .replicas import ReplicaTask

_CACHE: dict[tuple, Any] = {}
_CACHE_LOCK = threading.RLock()  # re-entrant: a replica task builds its replicas through get_task


def _as_list(v: Any) -> list[float] | None:
    if v is None or v == "" or v == []:
        return None
    if isinstance(v, str):
        return [float(s) for s in v.split(",") if s.strip()]
    if isinstance(v, (list, tuple)):
        return [float(s) for s in v]
    return [float(v)]


def task_spec(cfg: dict[str, Any]) -> str:
    """The canonical JSON text of a task's config keys: what every job message carries."""
    return json.dumps({k: cfg[k] for k in TASK_KEYS if k in cfg and cfg[k] is not None}, sort_keys=True)


def build_task(cfg: dict[str, Any] | str):
    """Make a task from its config keys (see ``TASK_KEYS``), given as a dict or ``task_spec`` text.

    ``replica-seeds`` (MNIST only): a ``ReplicaTask`` with one replica per listed seed.
    """
    if isinstance(cfg, str):
        cfg = json.loads(cfg)
    seeds = _as_list(cfg.get("replica-seeds"))
    if seeds:
        if str(cfg.get("task", "mnist")) != "mnist":
            raise ValueError("replicas are supported for the mnist task only")
        base = {k: v for k, v in cfg.items() if k != "replica-seeds"}
        return ReplicaTask([get_task({**base, "seed": int(s)}) for s in seeds])
    task = _build_task(cfg)
    task.seed = int(cfg.get("seed", 0))
    task.batch_size = int(cfg.get("batch-size", 64))
    return task


def _build_task(cfg: dict[str, Any]):
    name = str(cfg.get("task", "mnist"))
    n = int(cfg.get("num-partitions", 10))
    weights = _as_list(cfg.get("weights"))
    if name == "quadratic":
        a = _as_list(cfg.get("quad-a")) or [1.0] * n
        b = _as_list(cfg.get("quad-b")) or [float(i) for i in range(n)]
        if len(a) == 1 and n > 1:
            a = a * n
        return QuadraticTask(a, b, int(cfg.get("quad-dim", 1)), float(cfg.get("noise", 0.0)), weights)
    if name == "mnist":
        return MnistTask(
            n,
            float(cfg.get("dirichlet-alpha", 0.0)),
            int(cfg.get("seed", 0)),
            str(cfg.get("data-dir", "")) or None,
            int(cfg.get("batch-size", 64)),
            weights,
            partition=str(cfg.get("partition", "split")),
        )
    raise ValueError(f"unknown task {name!r}; choose one of {TASKS}")


def get_task(cfg: dict[str, Any] | str):
    """``build_task`` with a per-process cache keyed by the task's spec text."""
    key = cfg if isinstance(cfg, str) else task_spec(cfg)
    with _CACHE_LOCK:
        task = _CACHE.get(key)
        if task is None:
            task = _CACHE[key] = build_task(cfg)
    return task
