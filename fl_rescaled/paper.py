"""The paper's MNIST study: ``python run_sim.py paper [--quick]``.

For every method (Rescaled, Malenia and Ringleader ASGD, plus Vanilla and Delay-Adaptive ASGD as
extra rows) and every compute-time setting (fixed, exponential):

1. sweep the cycle stepsize α over the grid (default {1e-4, …, 1}) with seed 0 at the budget;
2. while the best α (lowest final training loss; a diverged run counts as +inf) sits at an edge of
   the grid, extend the grid past that edge (×10 below 1, half-decades 3, 10, 30, … above 1) until
   the choice is interior or the extension cap is reached;
3. run the remaining seeds at the chosen α.

Every finished run is stored as ``out/runs/<setting>/<method>/lr<α>_seed<s>.csv`` (its evaluation
history) and ``….json`` (the outcome without the history); a run whose JSON exists (same budget and
evaluation period) is not recomputed. Then the two toy problems are run, and the figures
(``out/fig_*.png``), curve CSVs (``out/curves/``) and ``out/REPORT.md`` are written.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import platform
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoints import atomic_path
from .metrics import write_history_csv

METHODS = ("rescaled", "malenia", "ringleader", "vanilla", "delay-adaptive")
PAPER_METHODS = ("rescaled", "malenia", "ringleader")
SETTINGS = ("fixed", "exponential")
DEFAULT_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
LABELS = {
    "rescaled": "Rescaled ASGD",
    "malenia": "Malenia SGD",
    "ringleader": "Ringleader ASGD",
    "vanilla": "Vanilla ASGD",
    "delay-adaptive": "Delay-Adaptive ASGD",
}
COLORS = {
    "rescaled": "tab:red",
    "malenia": "tab:blue",
    "ringleader": "tab:green",
    "vanilla": "tab:orange",
    "delay-adaptive": "tab:purple",
}
FULL = {"budget": 30000.0, "seeds": 5, "grid": DEFAULT_GRID, "eval_points": 200, "max_extend": 6,
        "toy_budgets": (4000.0, 20000.0)}
# Quick mode must finish within 3 minutes on a busy 2-core machine: a run costs ~1 ms of CPU per gradient
# (3.875 gradients per time unit; 2+ ms under load) plus ~0.19 s per evaluation of the 54k-example training
# set. 30 runs of budget 200: ~75 s of CPU; measured 125 s wall at load average 5.
QUICK = {"budget": 200.0, "seeds": 2, "grid": (0.1, 1.0), "eval_points": 5, "max_extend": 0,
         "toy_budgets": (1000.0, 5000.0)}
CURVE_POINTS = 200  # the time grid the curves are interpolated on (the paper's 200 points)
# Toy problems (experiments.md, appendix): deterministic gradients, two workers.
TOY1 = {"taus": [1.0, 2.0], "a": [1.0, 2.0], "b": [4.0, -3.0], "lr": 0.01, "x0": 0.0, "budget": 4000.0,
        "methods": ("rescaled", "vanilla")}
TOY2 = {"taus": [1.0, 100.0], "a": [1.0, 1.0], "b": [1.0, -1.0], "lr": 0.1, "x0": 5.0, "budget": 20000.0,
        "methods": ("delay-adaptive", "rescaled")}
SCHEMA = 1  # version of the stored run records


# ------------------------------------------------------------------------------------------ helpers
def fmt_lr(a: float) -> str:
    return f"{a:g}"


def clean(a: float) -> float:
    """Round away binary noise from ×10 / ×3 steps (0.30000000000000004 → 0.3)."""
    return float(f"{a:.10g}")


def next_up(a: float) -> float:
    """The next α above ``a``: ×10 below 1, half-decades (1, 3, 10, 30, …) from 1 up."""
    if a < 1.0 - 1e-12:
        return clean(a * 10)
    e = math.floor(math.log10(a) + 1e-9)
    m = a / 10**e
    return clean((3.0 if m < 2.0 else 10.0) * 10**e)


def next_down(a: float) -> float:
    return clean(a / 10)


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_csv(path: Path, history: list[dict[str, Any]]) -> None:
    with atomic_path(path) as tmp:
        write_history_csv(tmp, history)


def write_table_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    with atomic_path(path) as tmp, tmp.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows([[repr(v) if isinstance(v, float) else v for v in r] for r in rows])


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def score(rec: dict[str, Any]) -> float:
    """The selection criterion: the final training loss, +inf for a diverged run."""
    return float(rec["final_loss"]) if not rec.get("diverged") else math.inf


def quiet_logs() -> None:
    for name in ("fl_rescaled", "flwr"):
        logging.getLogger(name).setLevel(logging.ERROR)


# ------------------------------------------------------------------------------------------ one run
@dataclass(frozen=True)
class RunKey:
    setting: str
    method: str
    lr: float
    seed: int

    def stem(self) -> str:
        return f"lr{fmt_lr(self.lr)}_seed{self.seed}"

    def label(self) -> str:
        return f"{self.method} {self.setting} α={fmt_lr(self.lr)} seed={self.seed}"


def run_paths(out: Path, key: RunKey) -> tuple[Path, Path]:
    d = out / "runs" / key.setting / key.method
    return d / f"{key.stem()}.csv", d / f"{key.stem()}.json"


def load_stored(out: Path, key: RunKey, budget: float, eval_every: float) -> dict[str, Any] | None:
    """The stored record of a finished run, or None (absent, unreadable, or another budget)."""
    csv_path, json_path = run_paths(out, key)
    if not json_path.exists() or not csv_path.exists():
        return None
    try:
        rec = json.loads(json_path.read_text())
    except (OSError, ValueError):
        return None
    if (rec.get("schema") != SCHEMA or not math.isclose(rec.get("budget", -1), budget)
            or not math.isclose(rec.get("eval_every", -1), eval_every)):
        return None
    return rec


def execute_batch(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the runs of one job and store each (CSV history, then the JSON record last).

    ``job["runs"]``: [(α, seed), …] of one (setting, method) that share an event order; one run is
    ``experiment.run``, several are one batched ``experiment.run_batch`` (every replica's gradient
    in one ClientApp call per event). Module-level so worker processes can run it; returns one record, or
    {"error": ...}, per run.
    """
    from .experiment import RunSpec, run, run_batch

    keys = [RunKey(job["setting"], job["method"], float(a), int(sd)) for a, sd in job["runs"]]
    out = Path(job["out"])
    t0 = time.perf_counter()
    spec = RunSpec(task="mnist", strategy=keys[0].method, lr=keys[0].lr, delays=keys[0].setting, seed=keys[0].seed,
                   budget=job["budget"], eval_every=job["eval_every"], progress=job.get("bar", False))
    try:
        outcomes = [run(spec)] if len(keys) == 1 else run_batch(spec, [k.lr for k in keys], [k.seed for k in keys])
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which counts the runs as failed
        return [{"error": f"{type(exc).__name__}: {exc}", "key": k.__dict__} for k in keys]
    wall = time.perf_counter() - t0
    return [_store(out, key, outcome, job["eval_every"], wall / len(keys), len(keys))
            for key, outcome in zip(keys, outcomes)]


def _store(out: Path, key: RunKey, outcome: dict[str, Any], eval_every: float, wall: float,
           replicas: int) -> dict[str, Any]:
    csv_path, json_path = run_paths(out, key)
    history = outcome.pop("history")
    losses = [h.get("loss", math.nan) for h in history]
    final = outcome.get("final_loss")
    nonfinite = sum(v for k, v in (outcome.get("rejected") or {}).items() if "finite" in k)
    diverged = (not finite(final)) or nonfinite > 0 or (finite(losses[0]) and final > losses[0])
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
    atomic_write_csv(csv_path, history)
    atomic_write_text(json_path, json.dumps(rec, default=_json_default))
    return rec


def _json_default(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return str(v)


def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    quiet_logs()


# ------------------------------------------------------------------------------------------ sweeps
@dataclass
class Sweep:
    """The α search and the seeds of one (setting, method)."""

    setting: str
    method: str
    alphas: list[float]
    seeds: int
    max_extend: int
    results: dict[tuple[float, int], dict[str, Any]] = field(default_factory=dict)
    failed: set[tuple[float, int]] = field(default_factory=set)
    ext_up: int = 0
    ext_down: int = 0
    chosen: float | None = None
    note: str = ""

    def planned(self) -> int:
        return len(self.alphas) + self.seeds - 1

    def _done(self, k: tuple[float, int]) -> bool:
        return k in self.results or k in self.failed

    def needed(self) -> list[tuple[float, int]]:
        """Runs needed next (nothing while some of the current sweep is missing)."""
        sweep = [(a, 0) for a in self.alphas]
        missing = [k for k in sweep if not self._done(k)]
        if missing:
            return missing
        if self.chosen is None:
            self._decide()
            if self.chosen is None:
                return self.needed()
        return [(self.chosen, s) for s in range(1, self.seeds) if not self._done((self.chosen, s))]

    def scores(self) -> dict[float, float]:
        return {a: (score(self.results[(a, 0)]) if (a, 0) in self.results else math.inf) for a in self.alphas}

    def _decide(self) -> None:
        sc = self.scores()
        best = min(self.alphas, key=lambda a: (sc[a], a))
        if not math.isfinite(sc[best]):  # everything diverged: go down
            if self.ext_down < self.max_extend:
                self.ext_down += 1
                self.alphas.insert(0, next_down(self.alphas[0]))
                return
            self.chosen, self.note = best, "every α diverged (extension cap reached)"
            return
        if best == self.alphas[-1]:
            if self.ext_up < self.max_extend:
                self.ext_up += 1
                self.alphas.append(next_up(self.alphas[-1]))
                return
            self.chosen, self.note = best, f"top edge (upward extension capped at {self.max_extend})"
            return
        if best == self.alphas[0] and len(self.alphas) > 1:
            if self.ext_down < self.max_extend:
                self.ext_down += 1
                self.alphas.insert(0, next_down(self.alphas[0]))
                return
            self.chosen, self.note = best, f"bottom edge (downward extension capped at {self.max_extend})"
            return
        self.chosen, self.note = best, "interior"

    def seed_records(self) -> list[dict[str, Any]]:
        if self.chosen is None:
            return []
        return [self.results[(self.chosen, s)] for s in range(self.seeds) if (self.chosen, s) in self.results]


# ------------------------------------------------------------------------------------------ config
@dataclass
class StudyConfig:
    out: Path
    budget: float
    seeds: int
    grid: list[float]
    methods: list[str]
    settings: list[str]
    workers: int
    threads: int
    progress: bool
    batch: int
    report_only: bool
    eval_points: int
    max_extend: int
    quick: bool
    command: str
    toy_budgets: tuple[float, float] = (4000.0, 20000.0)

    @property
    def eval_every(self) -> float:
        return self.budget / self.eval_points


MAX_DEFAULT_WORKERS = 8  # each process holds its own torch and MNIST: about 1 GB resident (measured)


def default_workers() -> int:
    """One process per core this process may use, at most ``MAX_DEFAULT_WORKERS``: with one torch
    thread each, two processes gave 1.9× one process on this project's 2-core machine."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_WORKERS))


def _csv_list(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (as run_sim.py)
        sys.stderr.write(f"run_sim.py paper: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="run_sim.py paper",
        description="The paper's MNIST study: α sweep per method, seeds at the chosen α, fixed and "
                    "exponential compute times, toy problems, figures and REPORT.md. Resumes where it stopped.")
    p.add_argument("--out", default=None, help="output folder (default runs/paper, or runs/paper-quick with --quick)")
    p.add_argument("--quick", action="store_true",
                   help=f"small study: budget {QUICK['budget']:g}, {QUICK['seeds']} seeds, α grid "
                        f"{{{', '.join(fmt_lr(a) for a in QUICK['grid'])}}}, {QUICK['eval_points']} evaluations, "
                        f"at most {QUICK['max_extend']} grid extension")
    p.add_argument("--budget", type=float, default=None, help="simulated time per run (default 30000)")
    p.add_argument("--seeds", type=int, default=None, help="seeds at the chosen α (default 5)")
    p.add_argument("--grid", default=None, help="starting α grid, comma-separated (default 1e-4,1e-3,1e-2,1e-1,1)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated (default {','.join(METHODS)})")
    p.add_argument("--settings", default=",".join(SETTINGS), help="fixed,exponential (default both)")
    p.add_argument("--eval-points", type=int, default=None, help="evaluations per run (default 200; quick 10)")
    p.add_argument("--max-extend", type=int, default=None,
                   help="most grid extensions per direction (default 6; quick 1)")
    p.add_argument("--workers", type=int, default=None,
                   help=f"parallel processes, one run batch each (default: one per available core, at most "
                        f"{MAX_DEFAULT_WORKERS}; here {default_workers()})")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process (default 1: faster on a shared machine, see REPORT.md)")
    p.add_argument("--batch", type=int, default=5,
                   help="most runs computed together as replicas of one event loop (runs of one method that "
                        "share the event order: fixed τ, or one seed; default 5; 1 = one run at a time)")
    p.add_argument("--report-only", action="store_true",
                   help="compute nothing: write the figures and REPORT.md from the runs already stored "
                        "(an unfinished study is reported as such)")
    p.add_argument("--no-progress", action="store_true", help="no per-run lines")
    return p


def config_from_args(argv: list[str]) -> StudyConfig:
    p = build_parser()
    a = p.parse_args(argv)
    base = QUICK if a.quick else FULL
    try:
        grid = sorted({clean(float(s)) for s in _csv_list(a.grid)}) if a.grid else list(base["grid"])
    except ValueError:
        p.error(f"--grid: expected comma-separated numbers, got {a.grid!r}")
    methods = _csv_list(a.methods)
    settings = _csv_list(a.settings)
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        p.error(f"--methods: unknown {bad}; choose from {','.join(METHODS)}")
    if not settings or any(s not in SETTINGS for s in settings):
        p.error("--settings: choose from fixed,exponential")
    if not grid or any(not (g > 0 and math.isfinite(g)) for g in grid):
        p.error("--grid values must be positive")
    cfg = StudyConfig(
        out=Path(a.out or ("runs/paper-quick" if a.quick else "runs/paper")),
        budget=float(a.budget if a.budget is not None else base["budget"]),
        seeds=int(a.seeds if a.seeds is not None else base["seeds"]),
        grid=grid,
        methods=methods,
        settings=settings,
        workers=max(1, int(a.workers if a.workers is not None else default_workers())),
        threads=max(1, int(a.threads)),
        progress=not a.no_progress,
        batch=max(1, int(a.batch)),
        report_only=bool(a.report_only),
        eval_points=int(a.eval_points if a.eval_points is not None else base["eval_points"]),
        max_extend=int(a.max_extend if a.max_extend is not None else base["max_extend"]),
        quick=bool(a.quick),
        toy_budgets=tuple(base["toy_budgets"]),
        command="python run_sim.py paper " + " ".join(shlex.quote(s) for s in argv),
    )
    if (not (cfg.budget > 0 and math.isfinite(cfg.budget)) or cfg.seeds < 1 or cfg.eval_points < 1
            or cfg.max_extend < 0):
        p.error("--budget, --seeds and --eval-points must be positive, --max-extend non-negative")
    return cfg


# ------------------------------------------------------------------------------------------ driver
class Runner:
    """Schedules the runs of every sweep, inline (workers=1) or in a process pool."""

    def __init__(self, cfg: StudyConfig) -> None:
        self.cfg = cfg
        self.sweeps = [Sweep(s, m, list(cfg.grid), cfg.seeds, cfg.max_extend)
                       for s in cfg.settings for m in cfg.methods]
        self.order = sorted(range(len(self.sweeps)), key=lambda i: (self.sweeps[i].method not in PAPER_METHODS, i))
        self.computed = 0
        self.gradients = 0  # minibatch gradients (replica-steps) of the runs computed now
        self.reused = 0
        self.failed: list[dict[str, Any]] = []
        self.done = 0
        self.stage_seconds = {"sweep": 0.0, "seeds": 0.0}  # compute seconds of the runs made now
        self.t0 = time.perf_counter()

    def total(self) -> int:
        return sum(sw.planned() for sw in self.sweeps)

    def _job(self, sw: Sweep, ks: list[tuple[float, int]]) -> dict[str, Any]:
        # A live progress bar (stderr) only when runs are made here, one at a time, on a terminal.
        bar = self.cfg.progress and self.cfg.workers <= 1 and len(ks) == 1 and sys.stderr.isatty()
        return {"setting": sw.setting, "method": sw.method, "runs": [list(k) for k in ks], "out": str(self.cfg.out),
                "budget": self.cfg.budget, "eval_every": self.cfg.eval_every, "bar": bar}

    def _finish(self, sw: Sweep, k: tuple[float, int], rec: dict[str, Any]) -> None:
        self.done += 1
        key = RunKey(sw.setting, sw.method, k[0], k[1])
        if "error" in rec:
            sw.failed.add(k)
            self.failed.append(rec)
            print(f"[{self.done}/{self.total()}] {key.label()}: FAILED {rec['error']}", flush=True)
            return
        sw.results[k] = rec
        self.computed += 1
        self.gradients += int(rec.get("gradients", 0))
        self.stage_seconds["sweep" if k[1] == 0 else "seeds"] += rec.get("wall_total", 0.0)
        if self.cfg.progress:
            loss = rec["final_loss"]
            div = " (diverged)" if rec.get("diverged") else ""
            # ETA: the mean wall time per run computed so far, times the runs still planned.
            per = (time.perf_counter() - self.t0) / self.computed
            eta = per * max(self.total() - self.done, 0)
            batch = f" ×{rec['batch_replicas']}" if rec.get("batch_replicas", 1) > 1 else ""
            print(f"[{self.done}/{self.total()}] {sw.method:<15}{sw.setting:<12}α={fmt_lr(k[0]):<8}seed={k[1]}  "
                  f"final loss {loss:.4g}{div}  {rec.get('wall_total', 0.0):.1f} s{batch}  (eta {eta / 60:.0f} min)",
                  flush=True)

    def _collect_needed(self, inflight: set[tuple[int, tuple[float, int]]]) -> list[tuple[Sweep, tuple[float, int]]]:
        """Reuse stored runs as far as possible; return the runs that must be computed."""
        cfg = self.cfg
        todo: list[tuple[Sweep, tuple[float, int]]] = []
        progressed = True
        while progressed:
            progressed = False
            todo = []
            # The paper's three methods first (both settings), then the extra rows: if a study is cut
            # short, what it has is what the claims are about.
            for idx in self.order:
                sw = self.sweeps[idx]
                for k in sw.needed():
                    if (idx, k) in inflight:
                        continue
                    rec = load_stored(cfg.out, RunKey(sw.setting, sw.method, k[0], k[1]), cfg.budget, cfg.eval_every)
                    if rec is not None:
                        sw.results[k] = rec
                        self.reused += 1
                        self.done += 1
                        progressed = True
                    else:
                        todo.append((sw, k))
        return todo

    def _batches(self, todo: list[tuple[Sweep, tuple[float, int]]]) -> list[tuple[Sweep, list[tuple[float, int]]]]:
        """Group the needed runs into jobs of runs that share an event order: one (setting, method)
        and, unless compute times are fixed (then every α and seed has the same events), one seed;
        at most ``--batch`` runs per job."""
        groups: dict[tuple[int, int], tuple[Sweep, list[tuple[float, int]]]] = {}
        for sw, k in todo:
            gkey = (id(sw), -1 if sw.setting == "fixed" else k[1])
            groups.setdefault(gkey, (sw, []))[1].append(k)
        jobs = []
        for sw, ks in groups.values():
            for i in range(0, len(ks), self.cfg.batch):
                jobs.append((sw, ks[i:i + self.cfg.batch]))
        return jobs

    def run(self) -> None:
        self.t0 = time.perf_counter()
        if self.cfg.report_only:
            self._collect_needed(set())
            for sw in self.sweeps:  # a sweep still waiting for runs: its best finished α, marked provisional
                if sw.chosen is None and any(seed == 0 for _, seed in sw.results):
                    sc = {a: score(r) for (a, seed), r in sw.results.items() if seed == 0}
                    sw.chosen = min(sc, key=lambda a: (sc[a], a))
                    sw.note = "provisional: the sweep's runs are not all finished"
            return
        if self.cfg.workers <= 1:
            self._run_inline()
        else:
            self._run_pool()

    def _run_inline(self) -> None:
        _worker_init(self.cfg.threads)
        while True:
            jobs = self._batches(self._collect_needed(set()))
            if not jobs:
                return
            sw, ks = jobs[0]
            for k, rec in zip(ks, execute_batch(self._job(sw, ks))):
                self._finish(sw, k, rec)

    def _run_pool(self) -> None:
        import multiprocessing as mp
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
        index = {id(sw): i for i, sw in enumerate(self.sweeps)}
        pool = ProcessPoolExecutor(self.cfg.workers, mp_context=ctx, initializer=_worker_init,
                                   initargs=(self.cfg.threads,))
        futures: dict[Any, tuple[Sweep, list[tuple[float, int]]]] = {}
        inflight: set[tuple[int, tuple[float, int]]] = set()
        try:
            while True:
                # At most `workers` jobs in the pool, so decisions (grid extensions) are not delayed.
                for sw, ks in self._batches(self._collect_needed(inflight)):
                    if len(futures) >= self.cfg.workers:
                        break
                    futures[pool.submit(execute_batch, self._job(sw, ks))] = (sw, ks)
                    inflight.update((index[id(sw)], k) for k in ks)
                if not futures:
                    break
                done, _ = wait(list(futures), return_when=FIRST_COMPLETED)
                for fut in done:
                    sw, ks = futures.pop(fut)
                    inflight.difference_update((index[id(sw)], k) for k in ks)
                    try:
                        recs = fut.result()
                    except Exception as exc:  # noqa: BLE001 - a crashed worker process
                        recs = [{"error": f"{type(exc).__name__}: {exc}"} for _ in ks]
                    for k, rec in zip(ks, recs):
                        self._finish(sw, k, rec)
        except BaseException:
            # Interrupted: drop queued runs, stop the running ones (a run writes nothing partial).
            processes = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in processes:
                proc.terminate()
            raise
        pool.shutdown(wait=True)


# ------------------------------------------------------------------------------------------ toys
def run_quadratic(method: str, taus: list[float], budget: float, on_event, delays: str = "fixed", seed: int = 0,
                  lr: float = 0.01, a: list[float] | None = None, b: list[float] | None = None,
                  x0: float = 0.0) -> None:
    """One in-process run of ``method`` on the 1-d quadratic task (defaults: a_i = 1, b_i = i) on
    the virtual clock ``DelayModel(taus, delays, seed)``; ``on_event(comp, x)`` sees every event."""
    from flwr.app import Array, ArrayRecord

    from fl_rescaled.clients.client_app import app

    from .clock import DelayModel, VirtualClock
    from .experiment import RunSpec, make_strategy
    from .grid import InProcessGrid
    from .tasks import task_spec

    n = len(taus)
    strategy = make_strategy(RunSpec(task="quadratic", strategy=method, lr=lr, taus=taus, delays=delays, seed=seed,
                                     quad_a=a, quad_b=b).resolved())
    strategy.on_event = on_event
    cfg = {"task": "quadratic", "num-partitions": n}
    if a is not None:
        cfg.update({"quad-a": a, "quad-b": b})
    strategy.start(InProcessGrid(app, n), ArrayRecord({"model": Array(np.full(1, float(x0)))}),
                   time_budget=budget, train_config={"task": task_spec(cfg)},
                   clock=VirtualClock(DelayModel(taus, delays, seed)), eval_every=budget, partition_query=True)


def run_toy(method: str, toy: dict[str, Any]) -> list[tuple[float, float]]:
    """Every iterate (time, x) of one toy run, the start included (deterministic gradients)."""
    pts: list[tuple[float, float]] = [(0.0, float(toy["x0"]))]
    run_quadratic(method, toy["taus"], toy["budget"], lambda comp, x: pts.append((float(comp.time), float(x[0]))),
                  lr=toy["lr"], a=toy["a"], b=toy["b"], x0=toy["x0"])
    return pts


def cycle_iterates(pts: list[tuple[float, float]], tau_max: float, budget: float) -> list[tuple[float, float]]:
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
    a, b, taus = (np.asarray(toy[k], float) for k in ("a", "b", "taus"))
    freq = 1 / taus
    return {"equal": float(np.sum(a * b) / np.sum(a)), "frequency": float(np.sum(freq * a * b) / np.sum(freq * a))}


def load_or_run_toy(out: Path, name: str, method: str, toy: dict[str, Any]) -> tuple[list[tuple[float, float]], bool]:
    path = out / "toys" / f"{name}_{method}.csv"
    meta = {k: toy[k] for k in ("taus", "a", "b", "lr", "x0", "budget")}
    meta_path = path.with_suffix(".json")
    if path.exists() and meta_path.exists():
        try:
            if json.loads(meta_path.read_text()) == meta:
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
    from .experiment import default_taus

    taus = default_taus(10)
    meta = {"taus": taus, "delays": delays, "seed": int(seed), "budget": float(budget)}
    path = out / "toys" / f"staleness_{delays}.json" if out is not None else None
    if path is not None and path.exists():
        try:
            stored = json.loads(path.read_text())
            if stored.get("meta") == meta:
                return stored["stats"]
        except (OSError, ValueError):
            pass
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


# ------------------------------------------------------------------------------------------ curves
def read_curve(out: Path, rec: dict[str, Any]) -> dict[str, np.ndarray]:
    with (out / rec["csv"]).open() as fh:
        rows = list(csv.DictReader(fh))

    def col(name: str) -> np.ndarray:
        return np.array([float(r[name]) if r.get(name, "") != "" else math.nan for r in rows], dtype=float)

    return {"time": col("time"), "loss": col("loss"), "cumulative_stepsize": col("cumulative_stepsize")}


def band(curves: list[dict[str, np.ndarray]], key: str, tgrid: np.ndarray) -> tuple[np.ndarray, ...]:
    """Every run interpolated on ``tgrid`` (np.interp on its own evaluation times), then median/min/max."""
    ys = []
    for c in curves:
        y = c[key].copy()
        y[~np.isfinite(y)] = np.inf if key == "loss" else np.nan
        ys.append(np.interp(tgrid, c["time"], y))
    Y = np.vstack(ys)
    with np.errstate(invalid="ignore"):
        return np.median(Y, axis=0), np.min(Y, axis=0), np.max(Y, axis=0)


# ------------------------------------------------------------------------------------------ figures
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fig_loss(path: Path, bands: dict[str, dict[str, tuple]], tgrid: np.ndarray, chosen: dict, seeds: dict) -> None:
    plt = _plt()
    settings = list(bands)
    fig, axes = plt.subplots(1, len(settings), figsize=(5.2 * len(settings), 3.9), dpi=100, squeeze=False,
                             sharey=True)
    for ax, s in zip(axes[0], settings):
        for m, (med, lo, hi) in bands[s].items():
            ok = np.isfinite(med)
            ax.plot(tgrid[ok], med[ok], color=COLORS[m], lw=1.6,
                    label=f"{LABELS[m]} (α={fmt_lr(chosen[s][m])})")
            okb = np.isfinite(lo) & np.isfinite(hi)
            ax.fill_between(tgrid[okb], lo[okb], hi[okb], color=COLORS[m], alpha=0.18, lw=0)
        ax.set_yscale("log")
        n = seeds[s]
        ax.set_title(f"{s} compute times ({n} seed{'s' if n != 1 else ''}: median, min–max)", fontsize=10)
        ax.set_xlabel("time (simulated units)")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("training loss")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fig_stepsize(path: Path, cums: dict[str, dict[str, np.ndarray]], tgrid: np.ndarray, chosen: dict,
                 tau_max: float) -> None:
    """One panel per method: median cumulative stepsize vs time, fixed (solid) and exponential (dashed)."""
    plt = _plt()
    methods = [m for m in METHODS if any(m in c for c in cums.values())]
    fig, axes = plt.subplots(1, len(methods), figsize=(3.3 * len(methods), 3.3), dpi=100, squeeze=False)
    for ax, m in zip(axes[0], methods):
        refs: set[float] = set()
        for s, style in (("fixed", "-"), ("exponential", "--")):
            if m not in cums.get(s, {}):
                continue
            a = chosen[s][m]
            ax.plot(tgrid, cums[s][m], style, color=COLORS[m], lw=1.5, label=f"{s} (α={fmt_lr(a)})")
            if m == "rescaled" and a not in refs:  # the expected steady rate α/τ_max
                refs.add(a)
                ax.plot(tgrid, a / tau_max * tgrid, ":", color="k", lw=1, label=f"α·t/τ_max, α={fmt_lr(a)}")
        ax.set_title(LABELS[m], fontsize=10)
        ax.set_xlabel("time (simulated units)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("cumulative stepsize (median over seeds)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fig_toy(path: Path, toy: dict[str, Any], runs: dict[str, list[tuple[float, float]]], title: str,
            lines: list[tuple[float, str]]) -> None:
    plt = _plt()
    tau_max = max(toy["taus"])
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 3.9), dpi=100, sharey=True)
    for m, pts in runs.items():
        t, x = np.array(pts).T
        axes[0].plot(t, x, color=COLORS[m], lw=0.8, label=LABELS[m])
        ct, cx = np.array(cycle_iterates(pts, tau_max, toy["budget"])).T
        axes[1].plot(ct, cx, color=COLORS[m], lw=1.2, label=LABELS[m])
    for ax, what in zip(axes, ("all iterates", f"cycle iterates (every τ_max = {tau_max:g})")):
        for (y, lab), ls in zip(lines, ("--", ":")):
            ax.axhline(y, color="black", ls=ls, lw=0.9, label=lab)
        ax.set_xscale("symlog", linthresh=max(10 * tau_max, 10.0))
        ax.set_xlim(0, toy["budget"])
        ax.set_xlabel("time")
        ax.set_title(f"{title}: {what}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("x")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ report
def machine_info(threads: int, workers: int) -> dict[str, Any]:
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = (math.nan,) * 3
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": threads, "workers": workers,
            "load": " ".join(f"{v:.2f}" for v in load)}


def bare_loop_rate(seconds: float) -> float:
    """Steps/s of a bare loop of the paper's MLP step on this process's torch threads: one model,
    a minibatch gradient (the hand-written one every run uses) and an in-place SGD step, no Flower,
    no strategy, no evaluation. The yardstick for the study's replica-steps per second."""
    from .tasks import client_rng, get_task

    task = get_task({"task": "mnist", "seed": 0, "num-partitions": 10, "batch-size": 64, "dirichlet-alpha": 0.0})
    x = task.initial_params(0)
    buf = np.empty_like(x)
    k, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(50):
            g, _ = task.gradient(x, k % 10, client_rng(0, k % 10, k), 64, out=buf)
            x -= np.float32(0.01) * g
            k += 1
    return k / (time.perf_counter() - t0)


def read_timing_log(out: Path) -> list[dict[str, Any]]:
    path = out / "timing.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _med(vals: list[float]) -> float:
    v = [x for x in vals if x is not None]
    return float(np.median(v)) if v else math.nan


def _f(v: float, spec: str = ".4g") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def yn(b: bool) -> str:
    return "**yes**" if b else "**no**"


def summarize(recs: list[dict[str, Any]]) -> dict[str, Any]:
    losses = [score(r) for r in recs]
    clients = [r.get("client_losses") or [] for r in recs]
    n = max((len(c) for c in clients), default=0)
    per_client = [_med([c[i] for c in clients if len(c) > i]) for i in range(n)]
    return {
        "n": len(recs),
        "loss_med": _med(losses), "loss_min": float(min(losses)) if losses else math.nan,
        "loss_max": float(max(losses)) if losses else math.nan,
        "acc": _med([r.get("accuracy") for r in recs]),
        "worst": _med([max(c) for c in clients if c]),
        "spread": _med([max(c) - min(c) for c in clients if c]),
        "per_client": per_client,
        "updates": _med([r["num_updates"] for r in recs]),
        "discarded": _med([sum(r["discarded_per_worker"]) for r in recs]),
        "wasted": _med([r.get("wasted_time", 0.0) for r in recs]),
        "idle": _med([float(np.mean(r["idle_share_per_worker"])) for r in recs]),
        "wall": _med([r.get("wall_seconds", math.nan) for r in recs]),
        "cum": _med([r["cumulative_stepsize"] for r in recs]),
        "diverged": sum(bool(r.get("diverged")) for r in recs),
    }


def claims(cfg: StudyConfig, summ: dict, chosen: dict, curves: dict, tgrid: np.ndarray, sweeps: list[Sweep],
           tau_max: float, toys: dict) -> list[str]:
    """The paper's claims (experiments.md, "Claims"), checked against the numbers of this study.

    Returns the report lines: one plain summary line (which claims agree / disagree), then the details.
    """
    from .experiment import default_taus

    L: list[str] = []
    V: dict[str, bool] = {}  # claim → agrees
    S = cfg.settings

    def has(s: str, m: str) -> bool:
        return m in summ.get(s, {}) and summ[s][m]["n"] > 0

    # 1. Rescaled lower than Malenia and Ringleader in both settings.
    L.append("1. *Rescaled ASGD reaches a lower training loss than Malenia SGD and Ringleader ASGD in both "
             "settings* (median final loss over seeds, each method at its own chosen α):")
    verdicts = []
    for s in S:
        if not has(s, "rescaled"):
            continue
        r = summ[s]["rescaled"]["loss_med"]
        parts = []
        for m in ("malenia", "ringleader"):
            if has(s, m):
                o = summ[s][m]["loss_med"]
                verdicts.append(r < o)
                parts.append(f"{LABELS[m]} {_f(o)} → lower: {yn(r < o)} (ratio {_f(r / o, '.3g')})")
        L.append(f"   - {s}: Rescaled {_f(r)}; " + "; ".join(parts))
    if verdicts:
        separated = []
        for s in S:
            others = [summ[s][m]["loss_min"] for m in ("malenia", "ringleader") if has(s, m)]
            if has(s, "rescaled") and others:
                separated.append(summ[s]["rescaled"]["loss_max"] < min(others))
        V["1 (Rescaled below Malenia and Ringleader)"] = all(verdicts)
        L.append(f"   - Verdict: {'agrees' if all(verdicts) else 'disagrees'} "
                 f"({sum(verdicts)}/{len(verdicts)} comparisons hold); Rescaled's worst seed beats the other "
                 f"methods' best seed in every setting: {yn(all(separated))}.")
    # 2. Malenia and Ringleader slow down under exponential times; Rescaled barely changes.
    if all(s in S for s in SETTINGS):
        L.append("2. *Under exponential times Malenia and Ringleader slow down while Rescaled ASGD's curve is "
                 "virtually unchanged* (ratio exponential / fixed of the median final loss; > 1 = worse under "
                 "exponential; updates ratio < 1 = fewer model updates):")
        ratios = {}
        for m in cfg.methods:
            if has("fixed", m) and has("exponential", m):
                fl, el = summ["fixed"][m]["loss_med"], summ["exponential"][m]["loss_med"]
                fu, eu = summ["fixed"][m]["updates"], summ["exponential"][m]["updates"]
                ratios[m] = el / fl if fl > 0 else math.nan
                same = "same α" if chosen["fixed"][m] == chosen["exponential"][m] else \
                    f"α {fmt_lr(chosen['fixed'][m])} vs {fmt_lr(chosen['exponential'][m])}"
                L.append(f"   - {LABELS[m]}: loss {_f(fl)} → {_f(el)} (ratio {_f(ratios[m], '.3g')}), "
                         f"updates {_f(fu, '.0f')} → {_f(eu, '.0f')} "
                         f"(ratio {_f(eu / fu if fu else math.nan, '.3g')}); {same}")
        if "rescaled" in ratios:
            rr = ratios["rescaled"]
            # The two median curves compared over the second half of the run: the median of their ratio
            # (robust to the single-evaluation spikes of one-class data) decides; the final ratio is shown too.
            mid = rr
            if "rescaled" in curves.get("fixed", {}) and "rescaled" in curves.get("exponential", {}):
                a, b = curves["fixed"]["rescaled"], curves["exponential"]["rescaled"]
                half = tgrid >= tgrid[-1] / 2
                with np.errstate(divide="ignore", invalid="ignore"):
                    mid = float(np.exp(np.nanmedian(np.log(b[half] / a[half]))))
            close = 0.8 <= mid <= 1.25
            L.append(f"   - Rescaled virtually unchanged (median ratio exponential / fixed of its two median loss "
                     f"curves over the second half within [0.8, 1.25]): {yn(close)} (median ratio {_f(mid, '.3g')}, "
                     f"final-loss ratio {_f(rr, '.3g')}); not slowed down (median ratio ≤ 1.25): {yn(mid <= 1.25)}.")
            slow = [ratios[m] > 1 for m in ("malenia", "ringleader") if m in ratios]
            V["2 (Malenia and Ringleader slow down under exponential times)"] = bool(slow) and all(slow)
            key2 = "2 (Rescaled virtually unchanged under exponential times"
            key2 += ")" if close else (f": it does better there, median ratio {mid:.3g})" if mid < 1
                                       else f": it does worse there, median ratio {mid:.3g})")
            V[key2] = close
            stale = toys.get("staleness", {})
            if all(stale.get(s) for s in SETTINGS):
                def _st(s: str) -> str:
                    a, w = stale[s]["all"], stale[s]["slowest"]
                    return (f"{s} mean {a['mean']:.1f}, 99th percentile {a['p99']:.0f}, max {a['max']:.0f} "
                            f"(slowest workers: 99th percentile {w['p99']:.0f}, max {w['max']:.0f})")
                L.append("   - Staleness of the applied gradients in the ASGD event order (seed 0; updates applied "
                         f"between a gradient's dispatch and its use): {_st('fixed')}; {_st('exponential')}. "
                         "Same mean, heavier tail under exponential times"
                         + (f"; Vanilla ASGD, whose step is the same for every worker, has a ratio of "
                            f"{_f(ratios['vanilla'], '.3g')} against Rescaled's {_f(rr, '.3g')}, so the slowdown is "
                            "not specific to Rescaled's weighting" if "vanilla" in ratios else "")
                         + ". (A measured association, not a proof of cause.)")
            for m in ("malenia", "ringleader"):
                if m in ratios:
                    L.append(f"   - {LABELS[m]} slows down more than Rescaled (ratio {_f(ratios[m], '.3g')} > "
                             f"{_f(rr, '.3g')}): {yn(ratios[m] > rr)}; slows down at all (ratio > 1): "
                             f"{yn(ratios[m] > 1)}.")
    # 3. Cumulative stepsize of Rescaled grows at α/τ_max.
    if any(has(s, "rescaled") for s in S):
        L.append("3. *Rescaled ASGD's cumulative stepsize grows at the steady rate α/τ_max* (slope of the "
                 "median cumulative stepsize over the second half of the run vs α/τ_max):")
        for s in S:
            c = curves.get(s, {}).get("rescaled_cum")
            if c is None:
                continue
            half = tgrid >= tgrid[-1] / 2
            slope = float(np.polyfit(tgrid[half], c[half], 1)[0])
            expect = chosen[s]["rescaled"] / tau_max
            # Tolerance: 2 % (a window edge cuts a slow worker's step), plus for exponential times 3σ of the
            # Poisson noise of the deliveries in the window W: σ = sqrt(Σ τ_i / W) / n (relative).
            taus = default_taus(10)
            window = tgrid[-1] - tgrid[half][0]
            tol = 0.02 + (3 * math.sqrt(sum(taus) / window) / len(taus) if s == "exponential" else 0.0)
            ok = abs(slope / expect - 1) < tol
            c3 = "3 (cumulative stepsize of Rescaled at α/τ_max)"
            V[c3] = V.get(c3, True) and ok
            L.append(f"   - {s}: measured {_f(slope, '.4g')} per time unit, expected {_f(expect, '.4g')} "
                     f"(ratio {_f(slope / expect, '.4f')}; within the tolerance ±{tol:.1%}: {yn(ok)}).")
    # 4. The chosen α are interior to the grid.
    # A sweep without a final choice yet (unfinished study, --report-only) is pending, not a disagreement.
    decided = [sw for sw in sweeps if sw.chosen is not None and not sw.note.startswith("provisional")]
    if decided:
        V["4 (every chosen α interior to the grid)"] = all(sw.note == "interior" for sw in decided)
    L.append("4. *The chosen α are interior to the (extended) grid*: "
             + "; ".join(f"{sw.method}/{sw.setting} α={fmt_lr(sw.chosen) if sw.chosen else '—'} "
                         f"{'interior' if sw.note == 'interior' else (sw.note or 'sweep not finished')}"
                         for sw in sweeps) + ".")
    # 5. Toys.
    if toys:
        L.append("5. *Toy problems* (final iterate after the toy's budget):")
        if "toy1" in toys:
            t1 = toys["toy1"]
            xr, xv = t1["final"]["rescaled"], t1["final"]["vanilla"]
            V["5 (toy τ=(1,2): Rescaled → x*, Vanilla → x̃*)"] = (abs(xr - t1["fp"]["equal"]) < 0.05
                                                                  and abs(xv - t1["fp"]["frequency"]) < 0.05)
            L.append(f"   - τ=(1,2): Rescaled ends at {xr:.4f} (equal-weight minimiser {t1['fp']['equal']:.4f}; "
                     f"within 0.05: {yn(abs(xr - t1['fp']['equal']) < 0.05)}); Vanilla ends at {xv:.4f} "
                     f"(frequency-weighted minimiser {t1['fp']['frequency']:.4f}; within 0.05: "
                     f"{yn(abs(xv - t1['fp']['frequency']) < 0.05)}).")
        if "toy2" in toys:
            t2 = toys["toy2"]
            xd, xr = t2["final"]["delay-adaptive"], t2["final"]["rescaled"]
            V["5 (toy τ=(1,100): Delay-Adaptive → +1, Rescaled → 0)"] = abs(xd - 1) < 0.2 and abs(xr) < 0.1
            L.append(f"   - τ=(1,100): Delay-Adaptive ends at {xd:.4f} (near the fast worker's +1, within 0.2: "
                     f"{yn(abs(xd - 1) < 0.2)}); Rescaled ends at {xr:.4f} (near 0, within 0.1: {yn(abs(xr) < 0.1)}).")
    agree = [k for k, v in V.items() if v]
    disagree = [k for k, v in V.items() if not v]
    head = (f"**In short:** the results agree with claim(s) {'; '.join(agree) if agree else 'none'}; "
            f"they disagree with claim(s) {'; '.join(disagree) if disagree else 'none'}.")
    return [head, ""] + L


def write_report(cfg: StudyConfig, runner: Runner, summ: dict, chosen: dict, curves: dict, tgrid: np.ndarray,
                 toys: dict, timings: dict[str, float], machine: dict, figures: list[Path], tau_max: float) -> Path:
    from .clock import tau_stats
    from .experiment import default_taus

    taus = default_taus(10)
    st = tau_stats(taus)
    L = ["# The paper's MNIST study", ""]
    L.append(f"Command: `{cfg.command}`" + (" (quick mode: a smoke test, not the paper's budget)" if cfg.quick else ""))
    L.append("")
    L.append(f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')}. Budget {cfg.budget:g} time units per run, "
             f"evaluation every {cfg.eval_every:g} ({cfg.eval_points} points + start), {cfg.seeds} seed(s) at the "
             f"chosen α, MNIST with n = 10 one-class workers, MLP 784-128-10, batch 64, τ = "
             f"{', '.join(f'{t:g}' for t in taus)} (τ_max = {st['tau_max']:g}, τ_H = {st['tau_H']:.4g}).")
    missing = runner.total() - runner.done
    if missing > 0:
        L.append(f"**Incomplete study: {runner.done} of the {runner.total()} runs planned so far are finished "
                 f"({missing} missing).** Rows below use the finished runs only (fewer seeds, provisional α where "
                 "a sweep is unfinished); rerun the command without `--report-only` to complete it.")
        L.append("")
    L.append("α is the cycle stepsize (sum of stepsizes per τ_max time, experiments.md). The α of each method is "
             "picked by the final training loss of seed 0; diverged runs (non-finite loss or gradients, or a final "
             "loss above the initial one) count as +inf.")
    L.append("")
    L += ["## Machine and time", ""]
    L.append(f"- Machine: {machine['cpu']}, {machine['cores']} cores, {machine['platform']}, Python "
             f"{machine['python']}, torch {machine['torch']}; load average at start {machine['load']} (shared "
             "machine: timings are noisy).")
    L.append(f"- Processes in this invocation: {cfg.workers} × {cfg.threads} torch thread(s) (the invocations that "
             "computed runs are in the timing table below).")
    L.append(f"- This invocation: {runner.computed} run(s) computed, {runner.reused} reused from `runs/`"
             + (f", {len(runner.failed)} FAILED" if runner.failed else "") + ".")
    L.append(f"- Runs of one method that share an event order are computed together, up to {cfg.batch} "
             "replicas per event loop (one gradient call per event for all of them; `--batch`). Each replica runs "
             "the single run's kernels, so it equals its single run bit for bit; the seed-0 sweep records "
             "committed on 2026-11-26 were computed with an earlier stacked product, which agrees with the "
             "single run only to float32 rounding (and bit for bit only on the AMD EPYC it was written on).")
    for k, v in timings.items():
        L.append(f"- Wall time, {k}: {v:.1f} s")
    log_rows = read_timing_log(cfg.out)
    if log_rows:
        L.append("")
        L.append("Every invocation that computed runs (`timing.jsonl`); replica-steps = minibatch gradients of "
                 "all runs computed, bare loop = the same MLP step in a plain loop, one process, measured in "
                 "that invocation:")
        L.append("")
        L.append("| started | engine | processes × threads | runs | MNIST stage wall | replica-steps/s "
                 "(all processes) | bare loop steps/s (1 process) | note |")
        L.append("|---|---|---|---|---|---|---|---|")
        for r in log_rows:
            rate = r["gradients"] / r["seconds"] if r.get("seconds") else math.nan
            bare = r.get("bare_steps_per_s")
            L.append(f"| {r.get('started', '')} | {r.get('engine', '')} | {r.get('workers', '?')} × "
                     f"{r.get('threads', '?')} | {r.get('computed', 0)} | {r.get('seconds', 0) / 60:.1f} min | "
                     f"{rate:.0f} | {_f(bare, '.0f') if bare else '—'} | {r.get('note', '')} |")
        total = sum(r.get("seconds", 0.0) for r in log_rows)
        L.append("")
        L.append(f"- **Whole study, MNIST runs: {total / 60:.1f} min of wall time over {len(log_rows)} "
                 f"invocation(s)**, {sum(r.get('gradients', 0) for r in log_rows):,} replica-steps.")
    all_recs = [r for sw in runner.sweeps for r in sw.results.values()]
    sweep_secs = sum(r.get("wall_seconds", 0.0) for sw in runner.sweeps for (_, seed), r in sw.results.items()
                     if seed == 0)
    L.append(f"- Compute time of all stored runs of this study (sum of their wall times): "
             f"{sum(r.get('wall_seconds', 0.0) for r in all_recs):.0f} s over {len(all_recs)} runs; "
             f"sweep runs (seed 0) {sweep_secs:.0f} s.")
    L.append("")
    L += ["## α grids and choice", ""]
    L.append(f"Starting grid: {{{', '.join(fmt_lr(a) for a in cfg.grid)}}}; extension past an edge: ×10 below 1, "
             f"3, 10, 30, … above 1, at most {cfg.max_extend} step(s) per direction. Final loss of seed 0 per α "
             "(† = diverged: non-finite, or above the initial loss; counted as ∞):")
    L.append("")
    L.append("| setting | method | grid used | final loss per α (seed 0) | chosen α | choice |")
    L.append("|---|---|---|---|---|---|")
    for sw in runner.sweeps:
        sc = {}
        for a in sw.alphas:
            r = sw.results.get((a, 0))
            if r is None:
                sc[a] = "failed" if (a, 0) in sw.failed else "not run yet"
            elif r.get("diverged"):
                sc[a] = f"{r['final_loss']:.4g}† (∞)"
            else:
                sc[a] = f"{r['final_loss']:.4g}"
        ext = []
        if sw.ext_up:
            ext.append(f"+{sw.ext_up} up")
        if sw.ext_down:
            ext.append(f"+{sw.ext_down} down")
        grid_txt = "{" + ", ".join(fmt_lr(a) for a in sw.alphas) + "}" + (f" ({', '.join(ext)})" if ext else "")
        L.append(f"| {sw.setting} | {LABELS[sw.method]} | {grid_txt} | "
                 + ", ".join(f"{fmt_lr(a)}: {v}" for a, v in sc.items())
                 + f" | {fmt_lr(sw.chosen) if sw.chosen is not None else '—'} | {sw.note} |")
    L.append("")
    L += ["## Results at the chosen α", ""]
    L.append("Final training loss of the global objective (equal-weight average over the 10 clients): median "
             "[min, max] over seeds. Test accuracy, worst client (largest final local loss) and client spread "
             "(largest minus smallest local loss), updates, discarded jobs, wasted time and wall time are "
             "medians over seeds; idle = mean share of time a worker sat idle.")
    for s in cfg.settings:
        L += ["", f"### {s} compute times", ""]
        L.append("| method | α | final loss median [min, max] | test acc | worst client | spread | updates | "
                 "discarded | wasted time | idle | wall s/run | seeds |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for m in cfg.methods:
            x = summ[s].get(m)
            if not x or not x["n"]:
                continue
            div = f" ({x['diverged']} diverged)" if x["diverged"] else ""
            L.append(f"| {LABELS[m]} | {fmt_lr(chosen[s][m])} | {_f(x['loss_med'])} [{_f(x['loss_min'])}, "
                     f"{_f(x['loss_max'])}]{div} | {_f(x['acc'], '.2%')} | {_f(x['worst'])} | {_f(x['spread'])} | "
                     f"{_f(x['updates'], '.0f')} | {_f(x['discarded'], '.0f')} | {_f(x['wasted'], '.0f')} | "
                     f"{_f(x['idle'], '.1%')} | {_f(x['wall'], '.1f')} | {x['n']} |")
        L += ["", f"Final local loss of every client ({s}; median over seeds; client i holds digit i):", ""]
        L.append("| method | " + " | ".join(f"c{i} (τ={t:g})" for i, t in enumerate(taus)) + " |")
        L.append("|---|" + "---|" * len(taus))
        for m in cfg.methods:
            x = summ[s].get(m)
            if x and x["n"]:
                L.append(f"| {LABELS[m]} | " + " | ".join(_f(v, '.3g') for v in x["per_client"]) + " |")
    L += ["", "## Claims check (experiments.md, \"Claims\")", ""]
    L.append("Verdicts are computed from the numbers above, not written by hand.")
    L.append("")
    L += claims(cfg, summ, chosen, curves, tgrid, runner.sweeps, tau_max, toys)
    if cfg.quick:
        L += ["", "Quick mode: budget, seeds and grid are far below the paper's; the verdicts above describe this "
                  "small run only."]
    L += ["", "## Files", ""]
    for f in figures:
        L.append(f"- `{f.name}`")
    L.append("- `curves/`: the curves behind the figures (median/min/max on the time grid), one CSV per setting "
             "and method; `toys/`: every toy iterate and the staleness statistics; `runs/<setting>/<method>/lr<α>_seed<s>.csv|json`: every run.")
    path = cfg.out / "REPORT.md"
    atomic_write_text(path, "\n".join(L) + "\n")
    return path


# ------------------------------------------------------------------------------------------ main
def _log_timing(cfg: StudyConfig, runner: Runner, started: str, seconds: float, bare: float | None,
                note: str) -> None:
    """Append this invocation's MNIST-stage figures to ``timing.jsonl`` (the study may take several)."""
    if not runner.computed:
        return
    row = {"started": started, "seconds": seconds, "computed": runner.computed, "gradients": runner.gradients,
           "workers": cfg.workers, "threads": cfg.threads, "batch": cfg.batch,
           "engine": f"batched ≤{cfg.batch}" if cfg.batch > 1 else "one run per loop",
           "bare_steps_per_s": bare, "note": note}
    with (cfg.out / "timing.jsonl").open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(list(argv or []))
    quiet_logs()
    import torch

    torch.set_num_threads(cfg.threads)
    cfg.out.mkdir(parents=True, exist_ok=True)
    machine = machine_info(cfg.threads, cfg.workers)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    say = print if cfg.progress else (lambda *a, **k: None)
    say(f"paper study → {cfg.out}: methods {','.join(cfg.methods)}, settings {','.join(cfg.settings)}, "
        f"budget {cfg.budget:g}, {cfg.seeds} seed(s), grid {{{', '.join(fmt_lr(a) for a in cfg.grid)}}}, "
        f"{cfg.workers} process(es) × {cfg.threads} thread(s)", flush=True)

    # 1. MNIST runs (sweeps, extensions, seeds). SIGTERM stops them like Ctrl-C (worker processes included);
    # finished runs are on disk and the next invocation resumes from them.
    runner = Runner(cfg)
    t0 = time.perf_counter()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _interrupt)
    bare = None
    if not cfg.report_only:  # runs may be computed: measure the yardstick first
        bare = bare_loop_rate(2.0 if cfg.quick else 5.0)
        say(f"bare loop of the MLP step: {bare:.0f} steps/s (1 process, {cfg.threads} thread(s))", flush=True)
    started = time.strftime("%Y-%m-%d %H:%M")
    try:
        runner.run()
    except KeyboardInterrupt:
        _log_timing(cfg, runner, started, time.perf_counter() - t0, bare, "interrupted")
        print(f"paper study interrupted: {runner.computed} run(s) computed and {runner.reused} reused so far are "
              f"stored under {cfg.out / 'runs'}; run the same command again to resume.", file=sys.stderr, flush=True)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    timings["MNIST runs (this invocation)"] = time.perf_counter() - t0
    if runner.computed:
        _log_timing(cfg, runner, started, timings["MNIST runs (this invocation)"], bare, "")
        rate = runner.gradients / timings["MNIST runs (this invocation)"]
        say(f"MNIST runs: {runner.computed} computed, {runner.gradients:,} replica-steps in "
            f"{timings['MNIST runs (this invocation)']:.0f} s = {rate:.0f} replica-steps/s over {cfg.workers} "
            f"process(es); bare loop {bare or math.nan:.0f} steps/s in one process", flush=True)
    for k, v in runner.stage_seconds.items():
        if v:
            timings[f"computed {k} runs (sum of run times)"] = v

    # 2. Toys.
    t0 = time.perf_counter()
    toys: dict[str, Any] = {}
    toy_runs: dict[str, dict[str, list]] = {}
    toy_defs = {"toy1": {**TOY1, "budget": cfg.toy_budgets[0]}, "toy2": {**TOY2, "budget": cfg.toy_budgets[1]}}
    for name, toy in toy_defs.items():
        toy_runs[name] = {}
        for m in toy["methods"]:
            pts, _reused = load_or_run_toy(cfg.out, name, m, toy)
            toy_runs[name][m] = pts
        toys[name] = {"final": {m: p[-1][1] for m, p in toy_runs[name].items()}, "fp": toy_fixed_points(toy)}
    toys["staleness"] = {s: staleness(cfg.out, s, cfg.budget) for s in cfg.settings}
    timings["toy problems"] = time.perf_counter() - t0

    # 3. Curves, figures, report.
    t0 = time.perf_counter()
    from .experiment import default_taus

    tau_max = max(default_taus(10))
    tgrid = np.linspace(0.0, cfg.budget, CURVE_POINTS)
    chosen: dict[str, dict[str, float]] = {s: {} for s in cfg.settings}
    summ: dict[str, dict[str, Any]] = {s: {} for s in cfg.settings}
    bands: dict[str, dict[str, tuple]] = {s: {} for s in cfg.settings}
    cums: dict[str, dict[str, np.ndarray]] = {s: {} for s in cfg.settings}
    curves: dict[str, dict[str, np.ndarray]] = {s: {} for s in cfg.settings}
    seeds_used: dict[str, int] = {}
    for sw in runner.sweeps:
        recs = sw.seed_records()
        if sw.chosen is None or not recs:
            continue
        s, m = sw.setting, sw.method
        chosen[s][m] = sw.chosen
        summ[s][m] = summarize(recs)
        runs = [read_curve(cfg.out, r) for r in recs]
        med, lo, hi = band(runs, "loss", tgrid)
        cmed, clo, chi = band(runs, "cumulative_stepsize", tgrid)
        bands[s][m] = (med, lo, hi)
        cums[s][m] = cmed
        curves[s][m] = med
        curves[s][f"{m}_cum"] = cmed
        seeds_used[s] = max(seeds_used.get(s, 0), len(recs))
        write_table_csv(cfg.out / "curves" / f"{s}_{m}.csv",
                        ["time", "loss_median", "loss_min", "loss_max", "cumstep_median", "cumstep_min", "cumstep_max"],
                        [list(row) for row in zip(tgrid, med, lo, hi, cmed, clo, chi)])
    figures = []
    if any(bands.values()):
        figures.append(cfg.out / "fig_loss_vs_time.png")
        fig_loss(figures[-1], {s: b for s, b in bands.items() if b}, tgrid, chosen, seeds_used)
        figures.append(cfg.out / "fig_cumulative_stepsize.png")
        fig_stepsize(figures[-1], {s: c for s, c in cums.items() if c}, tgrid, chosen, tau_max)
    fp1, fp2 = toys["toy1"]["fp"], toys["toy2"]["fp"]
    figures.append(cfg.out / "fig_toy1_inconsistency.png")
    fig_toy(figures[-1], toy_defs["toy1"], toy_runs["toy1"], "τ=(1,2), α=0.01",
            [(fp1["equal"], f"x* = {fp1['equal']:.3g} (equal weights)"),
             (fp1["frequency"], f"x̃* = {fp1['frequency']:.3g} (frequency-weighted)")])
    figures.append(cfg.out / "fig_toy2_delay_adaptive.png")
    fig_toy(figures[-1], toy_defs["toy2"], toy_runs["toy2"], f"τ=(1,100), α={TOY2['lr']:g}",
            [(fp2["equal"], "x* = 0"), (1.0, "fast worker's minimiser +1")])
    timings["toys, figures and report"] = timings.pop("toy problems") + (time.perf_counter() - t0)
    timings["total (this invocation)"] = time.perf_counter() - t_start
    report = write_report(cfg, runner, summ, chosen, curves, tgrid, toys, timings, machine, figures, tau_max)
    stats = {"computed": runner.computed, "reused": runner.reused, "failed": len(runner.failed),
             "seconds": timings["total (this invocation)"], "command": cfg.command,
             "chosen": {s: {m: a for m, a in c.items()} for s, c in chosen.items()}}
    atomic_write_text(cfg.out / "summary.json", json.dumps(stats, indent=1))
    print(f"paper study: {runner.computed} run(s) computed, {runner.reused} reused, {len(runner.failed)} failed; "
          f"{timings['total (this invocation)']:.0f} s; report {report}", flush=True)
    return 1 if runner.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
