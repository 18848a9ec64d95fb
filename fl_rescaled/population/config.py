"""What the population study is: the population model, its four settings, its six methods with their
grids, the budgets (``FULL``, ``QUICK``) and the command line ``python run_sim.py population ...``.

Every run is a ``RunSpec`` (``spec_for``): N = 100 MNIST clients with label skew, lognormal compute
times around a lognormal τ profile, a daily availability cycle, at most C jobs in flight.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fl_rescaled.experiment import RunSpec
from fl_rescaled.paper.config import default_workers

#: The population model, the same in every setting and in quick mode (only the budget changes there).
MODEL: dict[str, Any] = {
    "num_clients": 100,
    "partition_size": 542,   # examples per client (the core's --partition mix: the rarest digit's 5,421 over 10)
    "delays": "lognormal",
    "delay_sigma": 0.5,      # job-to-job spread of log τ on one client: coefficient of variation 0.53
    "tau_profile": "lognormal",
    "tau_spread": 0.8,       # client-to-client spread of log τ_i: 5th–95th percentile 14× apart, mean 1
    "availability": "daily",
    "availability_period": 25.0,   # four "days" in the full budget of 100
    "availability_fraction": 0.5,  # online 12.5 time units a day: 12.5× the mean compute time
    "local_steps": 1,        # one minibatch of 64 per job, for every method
}


@dataclass(frozen=True)
class Setting:
    """One cell of the study: the Dirichlet label skew and the concurrency C."""

    dirichlet: float
    concurrency: int

    @property
    def label(self) -> str:  # a folder name
        return f"dir{self.dirichlet:g}_C{self.concurrency}"

    @property
    def title(self) -> str:
        skew = "one class per client" if self.dirichlet == 0 else f"Dirichlet {self.dirichlet:g}"
        return f"label skew α = {self.dirichlet:g} ({skew}), C = {self.concurrency}"


@dataclass(frozen=True)
class Method:
    """A method of the study: the registry strategy and its options, what its grid tunes (``knob``:
    the cycle stepsize ``lr`` or the clients' ``local_lr``) and the starting grid."""

    name: str
    label: str
    strategy: str
    knob: str
    grid: tuple[float, ...]
    options: dict[str, Any] = field(default_factory=dict)

    def knob_label(self) -> str:
        return "α" if self.knob == "lr" else "η_l"


METHODS: tuple[Method, ...] = (
    Method("fedavg", "FedAvg (sync)", "fedavg", "lr", (0.03, 0.1, 0.3)),
    Method("fedbuff", "FedBuff", "fedbuff", "local_lr", (0.1, 0.3, 1.0)),
    Method("fedasync", "FedAsync", "fedasync", "local_lr", (0.1, 0.3, 1.0)),
    Method("vanilla", "Vanilla ASGD", "vanilla", "lr", (3.0, 10.0, 30.0)),
    Method("rescaled-tau", "Rescaled(τ)", "rescaled", "lr", (3.0, 10.0, 30.0), {"by": "tau"}),
    Method("rescaled-rate", "Rescaled(rate)", "rescaled", "lr", (3.0, 10.0, 30.0), {"by": "rate"}),
)
BY_NAME = {m.name: m for m in METHODS}
RATE = "rescaled-rate"  # the method the verdicts are about
SETTINGS: tuple[Setting, ...] = (Setting(0.1, 10), Setting(0.1, 100), Setting(0.0, 10), Setting(0.0, 100))

# A full run costs about 1 ms of CPU per gradient (C = 100: ~130 gradients per time unit, C = 10: ~12)
# plus 0.26 s per evaluation; 24 (setting, method) pairs × (3 grid values + 2 more seeds) ≈ 120 runs.
FULL = {"budget": 100.0, "seeds": 3, "eval_points": 20, "max_extend": 2, "grid": "full"}
# Quick: one value per method (the grid's middle), one seed, a budget of 6 (FedAvg's first round of 50
# sampled clients closes after t = 4): 24 runs of a few seconds.
QUICK = {"budget": 6.0, "seeds": 1, "eval_points": 2, "max_extend": 0, "grid": "middle"}


def fedavg_concurrency(setting: Setting) -> int:
    """FedAvg's C: the setting's, except at C = N, where it is the mean number of clients online.

    Sampling d·N = 50 clients per round gives FedAvg as many clients per round as the asynchronous
    methods have in flight at C = N. (Chosen when the engine's synchronous round at C = N let a client
    that came online join the round in progress, so that under the daily cycle a round hardly ever
    closed: one round in a budget of 100. A round is now the clients online at its start; the choice
    stays, so that the study's stored runs stay valid.)
    """
    n = MODEL["num_clients"]
    if setting.concurrency < n:
        return setting.concurrency
    return max(1, round(MODEL["availability_fraction"] * n))


def spec_for(setting: Setting, method: Method, value: float, seed: int, budget: float,
             eval_every: float) -> RunSpec:
    """The ``RunSpec`` of one run: ``value`` is the method's knob (``lr`` or ``local_lr``)."""
    options = dict(method.options)
    c = fedavg_concurrency(setting) if method.strategy == "fedavg" else setting.concurrency
    if c < MODEL["num_clients"]:
        options["concurrency"] = c
    fields = {k: v for k, v in MODEL.items() if k != "partition_size"}
    return RunSpec(task="mnist", strategy=method.strategy, options=options, dirichlet_alpha=setting.dirichlet,
                   partition="mix",  # every client draws its digit mix, all of the same size (fl_rescaled.data)
                   seed=int(seed), budget=float(budget), eval_every=float(eval_every), workers=1, torch_threads=1,
                   **{method.knob: float(value)}, **fields)


def model_tag() -> str:
    """Identifies the population model and methods: a stored run of another model is not reused."""
    what = {"model": MODEL, "methods": [(m.name, m.strategy, m.knob, m.options) for m in METHODS], "partition": 1}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class PopulationConfig:
    """One invocation of the study (``config_from_args``)."""

    out: Path
    budget: float
    seeds: int
    eval_points: int
    max_extend: int
    workers: int
    report_only: bool
    progress: bool
    quick: bool
    command: str
    settings: tuple[Setting, ...] = SETTINGS
    methods: tuple[Method, ...] = METHODS

    @property
    def eval_every(self) -> float:
        return self.budget / self.eval_points

    def grid(self, method: Method) -> list[float]:
        return [method.grid[len(method.grid) // 2]] if self.quick else list(method.grid)

    def describe(self) -> dict[str, Any]:
        return {"budget": self.budget, "seeds": self.seeds, "eval_points": self.eval_points,
                "max_extend": self.max_extend, "quick": self.quick, "model": MODEL, "model_tag": model_tag(),
                "methods": [asdict(m) for m in self.methods]}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (as run_sim.py)
        sys.stderr.write(f"run_sim.py population: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="run_sim.py population",
                description="A population study: 100 MNIST clients, label skew 0.1 and 0, C = 10 and 100, lognormal "
                            "speeds with a daily availability cycle; FedAvg, FedBuff, FedAsync, Vanilla ASGD, "
                            "Rescaled(τ) and Rescaled(rate) at equal virtual time. Resumes where it stopped.")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke test: budget {QUICK['budget']:g}, {QUICK['seeds']} seed, one value per method")
    p.add_argument("--no-progress", action="store_true", help="no per-run lines")
    p.add_argument("--report-only", action="store_true",
                   help="compute nothing: write the figures and REPORT.md from the runs already stored")
    p.add_argument("--out", default=None,
                   help="output folder (default runs/population, or runs/population-quick with --quick)")
    p.add_argument("--workers", type=int, default=default_workers(),
                   help=f"parallel processes (default: one per available core, here {default_workers()})")
    return p


def config_from_args(argv: list[str]) -> PopulationConfig:
    """The study ``argv`` asks for; a bad flag exits with status 2 and one line on stderr."""
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.workers < 1:
        parser.error("--workers must be at least 1")
    base = QUICK if a.quick else FULL
    cfg = PopulationConfig(
        out=Path(a.out or ("runs/population-quick" if a.quick else "runs/population")),
        budget=float(base["budget"]), seeds=int(base["seeds"]), eval_points=int(base["eval_points"]),
        max_extend=int(base["max_extend"]), workers=int(a.workers), report_only=bool(a.report_only),
        progress=not a.no_progress, quick=bool(a.quick),
        command="python run_sim.py population " + " ".join(shlex.quote(s) for s in argv))
    assert math.isfinite(cfg.budget) and cfg.budget > 0
    return cfg
