"""The study's numbers: per (setting, method) the summary over seeds at the chosen value
(``paper.summaries.summarize``), the accuracy and loss curves on a common time grid (median, min,
max), and the verdicts: for every setting and metric, whether Rescaled(rate) is better than, equal
to, or worse than the best other method. Data only; ``report`` words it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fl_rescaled.paper.storage import write_table_csv
from fl_rescaled.paper.summaries import Band, band, summarize
from fl_rescaled.paper.sweep import score

from .config import RATE, PopulationConfig
from .runner import Runner

CURVE_POINTS = 101
UNSTABLE = 2.0  # a chosen value "did not carry over" when another seed ends above this × seed 0's final loss

#: The metrics the verdicts compare: summary key, what it is, and whether lower is better.
METRICS = (("loss_med", "final training loss", True), ("worst", "worst client's loss", True),
           ("acc", "test accuracy", False))


@dataclass
class Verdict:
    """Rescaled(rate) against the best other method on one metric of one setting (medians over seeds).
    ``outcome``: "wins" (strictly better), "ties" (equal) or "loses" (worse); ``overlap``: whether the
    seeds' [min, max] ranges of the two overlap (None with one seed)."""

    setting: str
    metric: str
    what: str
    rate: float
    best_method: str
    best: float
    outcome: str
    overlap: bool | None


@dataclass
class Results:
    """The population study's results: the chosen values, summaries, curves and verdicts per setting."""

    tgrid: np.ndarray
    chosen: dict[str, dict[str, float]] = field(default_factory=dict)  # setting → method → chosen value
    summary: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    curves: dict[str, dict[str, dict[str, Band]]] = field(default_factory=dict)  # setting → method → key → band
    verdicts: list[Verdict] = field(default_factory=list)
    same_runs: list[str] = field(default_factory=list)  # settings where Rescaled(rate) and (τ) ran identically
    # (setting, method, seed 0's final loss, the worst other seed's): choices that did not carry over
    unstable: list[tuple[str, str, float, float]] = field(default_factory=list)

    def has(self, setting: str, method: str) -> bool:
        return self.summary.get(setting, {}).get(method, {}).get("n", 0) > 0


def _curve(rec: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.array([math.nan if v is None else float(v) for v in rec["curve"][k]], dtype=float)
            for k in ("time", "loss", "accuracy")}


def _ranges(recs: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    def rng(vals: list[float]) -> tuple[float, float]:
        v = [x for x in vals if x is not None]
        return (float(min(v)), float(max(v))) if v else (math.nan, math.nan)

    return {"acc": rng([r.get("accuracy") for r in recs]), "worst": rng([r.get("worst_client_loss") for r in recs])}


def collect(cfg: PopulationConfig, runner: Runner) -> Results:
    """Summaries, curves (also written as ``out/curves/<setting>_<method>.csv``) and verdicts."""
    res = Results(np.linspace(0.0, cfg.budget, CURVE_POINTS))
    losses: dict[tuple[str, str], list[float]] = {}
    for c in runner.cells:
        recs = c.sweep.seed_records()
        if c.sweep.chosen is None or not recs:
            continue
        s, m = c.setting.label, c.method.name
        losses[(s, m)] = [score(r) for r in recs]
        if len(recs) > 1 and max(losses[(s, m)][1:]) > UNSTABLE * losses[(s, m)][0]:
            res.unstable.append((s, m, losses[(s, m)][0], max(losses[(s, m)][1:])))
        res.chosen.setdefault(s, {})[m] = c.sweep.chosen
        x = summarize(recs)
        x["ranges"] = {**_ranges(recs), "loss_med": (x["loss_min"], x["loss_max"])}
        x["lost"] = float(np.median([r["books"].get("lost", 0) for r in recs]))
        res.summary.setdefault(s, {})[m] = x
        runs = [_curve(r) for r in recs]
        res.curves.setdefault(s, {})[m] = {k: band(runs, k, res.tgrid) for k in ("accuracy", "loss")}
        acc, loss = res.curves[s][m]["accuracy"], res.curves[s][m]["loss"]
        write_table_csv(cfg.out / "curves" / f"{s}_{m}.csv",
                        ["time", "accuracy_median", "accuracy_min", "accuracy_max", "loss_median", "loss_min",
                         "loss_max"], [list(row) for row in zip(res.tgrid, *acc, *loss)])
    res.verdicts = verdicts(res.summary, [s.label for s in cfg.settings])
    res.same_runs = [s.label for s in cfg.settings if (s.label, RATE) in losses
                     and losses[(s.label, RATE)] == losses.get((s.label, "rescaled-tau"))
                     and res.chosen[s.label][RATE] == res.chosen[s.label]["rescaled-tau"]]
    return res


def verdicts(summary: dict[str, dict[str, dict[str, Any]]], settings: list[str]) -> list[Verdict]:
    """One verdict per setting and metric where Rescaled(rate) and at least one other method have runs.
    A method's number is its median over seeds; +inf for a diverged median loss."""
    out = []
    for s in settings:
        rows = summary.get(s, {})
        if RATE not in rows or len(rows) < 2:
            continue
        for key, what, lower in METRICS:
            sign = 1.0 if lower else -1.0
            others = {m: x[key] for m, x in rows.items() if m != RATE and not _nan(x[key])}
            mine = rows[RATE][key]
            if not others or _nan(mine):
                continue
            best_m = min(others, key=lambda m: (sign * others[m], m))
            best = others[best_m]
            outcome = "ties" if mine == best else ("wins" if sign * mine < sign * best else "loses")
            overlap = None
            if rows[RATE]["n"] > 1 and rows[best_m]["n"] > 1:
                (a, b), (c, d) = rows[RATE]["ranges"][key], rows[best_m]["ranges"][key]
                overlap = bool(a <= d and c <= b)
            out.append(Verdict(s, key, what, float(mine), best_m, float(best), outcome, overlap))
    return out


def _nan(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def write_results_csv(path: Path, res: Results, cfg: PopulationConfig) -> None:
    """The table of the report, one row per (setting, method): the numbers the verdicts read."""
    rows = []
    for s in cfg.settings:
        for m in cfg.methods:
            if res.has(s.label, m.name):
                x = res.summary[s.label][m.name]
                rows.append([s.label, m.name, m.knob, res.chosen[s.label][m.name], x["n"], x["loss_med"],
                             x["loss_min"], x["loss_max"], x["worst"], x["acc"], x["updates"], x["lost"], x["idle"]])
    write_table_csv(path, ["setting", "method", "knob", "value", "seeds", "final_loss_median", "final_loss_min",
                           "final_loss_max", "worst_client_loss_median", "accuracy_median", "updates_median",
                           "lost_jobs_median", "idle_share_median"], rows)
