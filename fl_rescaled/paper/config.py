"""What a study is: its methods, settings, budgets and grid (``StudyConfig``), and the command line
``python run_sim.py paper [--quick] ...`` that sets them (``config_from_args``)."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from ..settings import available_cores
from .sweep import clean, fmt_lr

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
FULL = {"budget": 30000.0, "seeds": 5, "grid": DEFAULT_GRID, "eval_points": 200, "max_extend": 6,
        "toy_budgets": (4000.0, 20000.0)}
# Quick mode must finish within 3 minutes on a busy 2-core machine: a run costs ~1 ms of CPU per gradient
# (3.875 gradients per time unit; 2+ ms under load) plus ~0.19 s per evaluation of the 54k-example training
# set. 30 runs of budget 200: ~75 s of CPU; measured 125 s wall at load average 5.
QUICK = {"budget": 200.0, "seeds": 2, "grid": (0.1, 1.0), "eval_points": 5, "max_extend": 0,
         "toy_budgets": (1000.0, 5000.0)}
MAX_DEFAULT_WORKERS = 8  # each process holds its own torch and MNIST: about 1 GB resident (measured)


@dataclass
class StudyConfig:
    """One study, as the command line sets it (``config_from_args``); ``--quick`` starts from QUICK,
    otherwise from FULL."""

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


def default_workers() -> int:
    """One process per core this process may use, at most ``MAX_DEFAULT_WORKERS``: with one torch
    thread each, two processes gave 1.9× one process on this project's 2-core machine."""
    return min(available_cores(), MAX_DEFAULT_WORKERS)


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
    p.add_argument("--eval-points", type=int, default=None,
                   help=f"evaluations per run (default {FULL['eval_points']}; quick {QUICK['eval_points']})")
    p.add_argument("--max-extend", type=int, default=None,
                   help=f"most grid extensions per direction (default {FULL['max_extend']}; quick {QUICK['max_extend']})")
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
    """The study ``argv`` asks for; a bad flag or value exits with status 2 and one line on stderr."""
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
