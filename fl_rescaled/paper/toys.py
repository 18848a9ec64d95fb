"""The two toy problems (experiments.md, appendix) and the staleness statistics of the study's
event order: in-process runs on the 1-d quadratic task, deterministic gradients, seconds each.

Toy 1 (τ = 1, 2): Rescaled ASGD goes to the equal-weight minimiser x*, Vanilla ASGD to the
frequency-weighted x̃*. Toy 2 (τ = 1, 100): Delay-Adaptive ASGD settles near the fast worker's
minimiser +1, Rescaled ASGD near 0. Iterates are cached under ``out/toys/``.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from fl_rescaled.clients.client_app import app
from fl_rescaled.clock import DEFAULT_TAUS, DelayModel, VirtualClock
from fl_rescaled.experiment import RunSpec, make_strategy
from fl_rescaled.grid import InProcessGrid
from fl_rescaled.manager import OnEvent
from fl_rescaled.tasks import task_spec

from .config import StudyConfig
from .storage import atomic_write_text, read_json, write_table_csv

# Deterministic gradients, two workers; "budget" is replaced by the study's toy budget.
TOY1 = {"taus": [1.0, 2.0], "a": [1.0, 2.0], "b": [4.0, -3.0], "lr": 0.01, "x0": 0.0, "budget": 4000.0,
        "methods": ("rescaled", "vanilla")}
TOY2 = {"taus": [1.0, 100.0], "a": [1.0, 1.0], "b": [1.0, -1.0], "lr": 0.1, "x0": 5.0, "budget": 20000.0,
        "methods": ("delay-adaptive", "rescaled")}

Iterates = list[tuple[float, float]]  # (time, x), the start included


def run_quadratic(method: str, taus: list[float], budget: float, on_event, delays: str = "fixed", seed: int = 0,
                  lr: float = 0.01, a: list[float] | None = None, b: list[float] | None = None,
                  x0: float = 0.0) -> None:
    """One in-process run of ``method`` on the 1-d quadratic task (defaults: a_i = 1, b_i = i) on
    the virtual clock ``DelayModel(taus, delays, seed)``; ``on_event(comp, x)`` sees every event."""
    n = len(taus)
    strategy = make_strategy(RunSpec(task="quadratic", strategy=method, lr=lr, taus=taus, delays=delays, seed=seed,
                                     quad_a=a, quad_b=b).resolved())
    cfg = {"task": "quadratic", "num-partitions": n}
    if a is not None:
        cfg.update({"quad-a": a, "quad-b": b})
    strategy.start(InProcessGrid(app, n), ArrayRecord({"model": Array(np.full(1, float(x0)))}),
                   time_budget=budget, train_config={"task": task_spec(cfg)},
                   clock=VirtualClock(DelayModel(taus, delays, seed)), eval_every=budget, partition_query=True,
                   observers=[OnEvent(on_event)])


def run_toy(method: str, toy: dict[str, Any]) -> Iterates:
    """Every iterate (time, x) of one toy run, the start included (deterministic gradients)."""
    pts: Iterates = [(0.0, float(toy["x0"]))]
    run_quadratic(method, toy["taus"], toy["budget"], lambda comp, x: pts.append((float(comp.time), float(x[0]))),
                  lr=toy["lr"], a=toy["a"], b=toy["b"], x0=toy["x0"])
    return pts


def cycle_iterates(pts: Iterates, tau_max: float, budget: float) -> Iterates:
    """The model at the start of each τ_max-cycle: after every event at times ≤ k·τ_max."""
    out, j, x = [], 0, pts[0][1]
    k = 0
    while k * tau_max <= budget + 1e-9:
        t = k * tau_max
        while j < len(pts) and pts[j][0] <= t + 1e-9:
            x = pts[j][1]
            j += 1
        out.append((t, x))
        k += 1
    return out


def toy_fixed_points(toy: dict[str, Any]) -> dict[str, float]:
    """The minimisers of the equal-weight and of the frequency-weighted (1/τ_i) objective."""
    a, b, taus = (np.asarray(toy[k], float) for k in ("a", "b", "taus"))
    freq = 1 / taus
    return {"equal": float(np.sum(a * b) / np.sum(a)), "frequency": float(np.sum(freq * a * b) / np.sum(freq * a))}


def load_or_run_toy(out: Path, name: str, method: str, toy: dict[str, Any]) -> tuple[Iterates, bool]:
    """The iterates of one toy run: from ``out/toys/<name>_<method>.csv`` when it was made with the
    same toy, else computed and stored. Returns (iterates, reused)."""
    path = out / "toys" / f"{name}_{method}.csv"
    meta = {k: toy[k] for k in ("taus", "a", "b", "lr", "x0", "budget")}
    meta_path = path.with_suffix(".json")
    if path.exists() and read_json(meta_path) == meta:
        try:
            with path.open() as fh:
                rows = list(csv.reader(fh))[1:]
            return [(float(r[0]), float(r[1])) for r in rows], True
        except (OSError, ValueError, IndexError):
            pass
    pts = run_toy(method, toy)
    write_table_csv(path, ["time", "x"], [[t, x] for t, x in pts])
    atomic_write_text(meta_path, json.dumps(meta))
    return pts, False


def staleness(out: Path | None, delays: str, budget: float, seed: int = 0) -> dict[str, Any]:
    """Staleness of the applied gradients in the ASGD family's event order: the updates applied
    between a gradient's dispatch and its use. Every ASGD method applies each gradient at once and
    sends its worker the new model, so the staleness depends only on the compute times; a quadratic
    run on the study's τ and clock (``DelayModel(τ, delays, seed)``, as every MNIST run of that seed)
    gives it in seconds. Cached as ``toys/staleness_<delays>.json`` when ``out`` is given."""
    taus = list(DEFAULT_TAUS)
    meta = {"taus": taus, "delays": delays, "seed": int(seed), "budget": float(budget)}
    path = out / "toys" / f"staleness_{delays}.json" if out is not None else None
    stored = read_json(path) if path is not None else None
    if isinstance(stored, dict) and stored.get("meta") == meta:
        return stored["stats"]
    seen: list[tuple[int, int]] = []
    run_quadratic("vanilla", taus, budget, lambda comp, x: seen.append((comp.worker, comp.delay)), delays, seed)
    workers = np.array([w for w, _ in seen])
    delay = np.array([d for _, d in seen], dtype=float)
    slow = delay[np.asarray(taus)[workers] == max(taus)]

    def summary(d: np.ndarray) -> dict[str, float]:
        return {"mean": float(d.mean()), "p99": float(np.percentile(d, 99)), "max": float(d.max())} if d.size else {}

    stats = {"all": summary(delay), "slowest": summary(slow), "updates": int(delay.size)}
    if path is not None:
        atomic_write_text(path, json.dumps({"meta": meta, "stats": stats}))
    return stats


@dataclass
class ToyResults:
    """The toy runs of one study and the staleness statistics of its settings."""

    toys: dict[str, dict[str, Any]]  # "toy1", "toy2" → TOY1, TOY2 at the study's toy budgets
    iterates: dict[str, dict[str, Iterates]]  # toy → method → every iterate
    staleness: dict[str, dict[str, Any]]  # setting → ``staleness(out, setting, budget)``

    def final(self, name: str, method: str) -> float:
        return self.iterates[name][method][-1][1]

    def fixed_points(self, name: str) -> dict[str, float]:
        return toy_fixed_points(self.toys[name])


def run_toys(cfg: StudyConfig) -> ToyResults:
    """Both toys with every method they compare (cached runs reused), then the staleness statistics."""
    toys = {"toy1": {**TOY1, "budget": cfg.toy_budgets[0]}, "toy2": {**TOY2, "budget": cfg.toy_budgets[1]}}
    iterates = {name: {m: load_or_run_toy(cfg.out, name, m, toy)[0] for m in toy["methods"]}
                for name, toy in toys.items()}
    return ToyResults(toys, iterates, {s: staleness(cfg.out, s, cfg.budget) for s in cfg.settings})
