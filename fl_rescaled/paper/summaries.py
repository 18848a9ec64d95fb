"""The study's numbers at each chosen α: per-method summaries over seeds (``summarize``) and the
median/min/max curves on a common time grid (``band``), gathered in ``Results``; the curves are
also written as ``out/curves/<setting>_<method>.csv``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .config import StudyConfig
from .storage import read_curve, write_table_csv
from .sweep import Sweep, score

CURVE_POINTS = 200  # the time grid the curves are interpolated on (the paper's 200 points)

Band = tuple[np.ndarray, np.ndarray, np.ndarray]  # median, min, max over seeds


def median(vals: list[float]) -> float:
    """The median of the values that are not None; NaN when there are none."""
    v = [x for x in vals if x is not None]
    return float(np.median(v)) if v else math.nan


def summarize(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The stored runs of one method at its chosen α (one per seed), in a few numbers: the final
    loss (median, min, max; +inf for a diverged run) and medians over seeds of the rest."""
    losses = [score(r) for r in recs]
    clients = [r.get("client_losses") or [] for r in recs]
    n = max((len(c) for c in clients), default=0)
    per_client = [median([c[i] for c in clients if len(c) > i]) for i in range(n)]
    return {
        "n": len(recs),
        "loss_med": median(losses), "loss_min": float(min(losses)) if losses else math.nan,
        "loss_max": float(max(losses)) if losses else math.nan,
        "acc": median([r.get("accuracy") for r in recs]),
        "worst": median([max(c) for c in clients if c]),
        "spread": median([max(c) - min(c) for c in clients if c]),
        "per_client": per_client,
        "updates": median([r["num_updates"] for r in recs]),
        "discarded": median([sum(r["discarded_per_worker"]) for r in recs]),
        "wasted": median([r.get("wasted_time", 0.0) for r in recs]),
        "idle": median([float(np.mean(r["idle_share_per_worker"])) for r in recs]),
        "wall": median([r.get("wall_seconds", math.nan) for r in recs]),
        "cum": median([r["cumulative_stepsize"] for r in recs]),
        "diverged": sum(bool(r.get("diverged")) for r in recs),
    }


def band(curves: list[dict[str, np.ndarray]], key: str, tgrid: np.ndarray) -> Band:
    """Every run interpolated on ``tgrid`` (np.interp on its own evaluation times), then median/min/max."""
    ys = []
    for c in curves:
        y = c[key].copy()
        y[~np.isfinite(y)] = np.inf if key == "loss" else np.nan
        ys.append(np.interp(tgrid, c["time"], y))
    Y = np.vstack(ys)
    with np.errstate(invalid="ignore"):
        return np.median(Y, axis=0), np.min(Y, axis=0), np.max(Y, axis=0)


@dataclass
class Results:
    """Everything the figures, the claims and the report read, per setting and method (a method
    appears once its sweep has a chosen α and at least one finished run there)."""

    tgrid: np.ndarray  # CURVE_POINTS times from 0 to the budget
    chosen: dict[str, dict[str, float]]  # setting → method → chosen α
    summary: dict[str, dict[str, dict[str, Any]]]  # setting → method → ``summarize``
    loss: dict[str, dict[str, Band]]  # setting → method → training loss on ``tgrid``
    cumstep: dict[str, dict[str, Band]]  # setting → method → cumulative stepsize on ``tgrid``
    seeds: dict[str, int]  # setting → most seeds of one method

    def has(self, setting: str, method: str) -> bool:
        return method in self.summary.get(setting, {}) and self.summary[setting][method]["n"] > 0


def collect(cfg: StudyConfig, sweeps: list[Sweep]) -> Results:
    """Summaries and curves of every sweep with a chosen α; writes the curve CSVs."""
    tgrid = np.linspace(0.0, cfg.budget, CURVE_POINTS)
    res = Results(tgrid, chosen={s: {} for s in cfg.settings}, summary={s: {} for s in cfg.settings},
                  loss={s: {} for s in cfg.settings}, cumstep={s: {} for s in cfg.settings}, seeds={})
    for sw in sweeps:
        recs = sw.seed_records()
        if sw.chosen is None or not recs:
            continue
        s, m = sw.setting, sw.method
        res.chosen[s][m] = sw.chosen
        res.summary[s][m] = summarize(recs)
        runs = [read_curve(cfg.out, r) for r in recs]
        res.loss[s][m] = band(runs, "loss", tgrid)
        res.cumstep[s][m] = band(runs, "cumulative_stepsize", tgrid)
        res.seeds[s] = max(res.seeds.get(s, 0), len(recs))
        write_curves(cfg.out / "curves" / f"{s}_{m}.csv", tgrid, res.loss[s][m], res.cumstep[s][m])
    return res


def write_curves(path: Path, tgrid: np.ndarray, loss: Band, cumstep: Band) -> None:
    write_table_csv(path,
                    ["time", "loss_median", "loss_min", "loss_max", "cumstep_median", "cumstep_min", "cumstep_max"],
                    [list(row) for row in zip(tgrid, *loss, *cumstep)])
