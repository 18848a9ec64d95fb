"""The study's files: every finished run as ``out/runs/<setting>/<method>/lr<α>_seed<s>.csv`` (its
evaluation history) and ``….json`` (the outcome without the history), plus the small tables and
caches beside them. Every file is written atomically: a stopped study leaves no partial file, and
a run whose JSON exists (same schema, budget and evaluation period) is reused, not recomputed."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from fl_rescaled.checkpoints import atomic_path
from fl_rescaled.metrics import write_history_csv

from .sweep import RunKey

SCHEMA = 1  # version of the stored run records


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_table_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    with atomic_path(path) as tmp, tmp.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows([[repr(v) if isinstance(v, float) else v for v in r] for r in rows])


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or None when it is absent or unreadable."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_paths(out: Path, key: RunKey) -> tuple[Path, Path]:
    d = out / "runs" / key.setting / key.method
    return d / f"{key.stem()}.csv", d / f"{key.stem()}.json"


def load_stored(out: Path, key: RunKey, budget: float, eval_every: float) -> dict[str, Any] | None:
    """The stored record of a finished run, or None (absent, unreadable, or another budget)."""
    csv_path, json_path = run_paths(out, key)
    if not json_path.exists() or not csv_path.exists():
        return None
    rec = read_json(json_path)
    if (not isinstance(rec, dict) or rec.get("schema") != SCHEMA or not math.isclose(rec.get("budget", -1), budget)
            or not math.isclose(rec.get("eval_every", -1), eval_every)):
        return None
    return rec


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def store_run(out: Path, key: RunKey, outcome: dict[str, Any], eval_every: float, wall: float,
              replicas: int) -> dict[str, Any]:
    """Write one run's history (CSV), then its record (JSON, last: it marks the run finished).

    A run counts as diverged when its final loss is not finite, a gradient was rejected as
    non-finite, or it ends above its initial loss. Returns the record.
    """
    csv_path, json_path = run_paths(out, key)
    history = outcome.pop("history")
    losses = [h.get("loss", math.nan) for h in history]
    final = outcome.get("final_loss")
    nonfinite = sum(v for k, v in (outcome.get("rejected") or {}).items() if "finite" in k)
    diverged = (not _finite(final)) or nonfinite > 0 or (_finite(losses[0]) and final > losses[0])
    rec = {
        "schema": SCHEMA,
        **{k: v for k, v in outcome.items() if k not in ("csv", "png", "checkpoint") and not isinstance(v, np.ndarray)},
        "eval_every": eval_every,
        "initial_loss": losses[0],
        "diverged": bool(diverged),
        "nonfinite_rejections": nonfinite,
        "wall_total": wall,  # this run's share of its batch's wall time
        "batch_replicas": replicas,
        "csv": str(csv_path.relative_to(out)),
    }
    with atomic_path(csv_path) as tmp:
        write_history_csv(tmp, history)
    atomic_write_text(json_path, json.dumps(rec, default=_json_default))
    return rec


def _json_default(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return str(v)


def read_curve(out: Path, rec: dict[str, Any]) -> dict[str, np.ndarray]:
    """The evaluation history of a stored run: time, loss and cumulative stepsize (NaN where empty)."""
    with (out / rec["csv"]).open() as fh:
        rows = list(csv.DictReader(fh))

    def col(name: str) -> np.ndarray:
        return np.array([float(r[name]) if r.get(name, "") != "" else math.nan for r in rows], dtype=float)

    return {"time": col("time"), "loss": col("loss"), "cumulative_stepsize": col("cumulative_stepsize")}
