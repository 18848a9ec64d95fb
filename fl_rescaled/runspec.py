"""``RunSpec``: everything that defines one simulated run, declared once.

Each field carries its description (``help``); the command line (``--eval-every``), the Flower run
config (``eval-every = 100.0``) and the experiment runner all read the fields from here, so a
default lives in one place. The strategy's own options are not fields: they are the keyword
arguments of its constructor, collected in ``options`` (see ``fl_rescaled.strategies.options``);
``lr`` (the cycle stepsize α) is a field because every run, sweep and file name has one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .clock import DELAY_KINDS, tau_stats
from .strategies.options import parse_value
from .tasks import TASKS


def _f(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - the field's description
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


#: The most clients a run may have (each one has its books and its τ; a million is far beyond the
#: largest study here, and a typo such as --num-clients 1e9 should not exhaust memory first).
MAX_CLIENTS = 1_000_000


#: Integer fields and the values they may take (beyond these a run would exhaust memory or time
#: before it could say why: a 10^30 minibatch, 10^30 local steps, a seed numpy refuses).
INT_RANGES = (("batch_size", 1, 1_000_000), ("local_steps", 1, 1_000_000), ("quad_dim", 1, 100_000_000),
              ("workers", 1, 1024), ("torch_threads", 1, 1024), ("seed", 0, 2**63 - 1))
#: The most evaluations a run may ask for (``budget / eval_every``).
MAX_EVALUATIONS = 1_000_000


def default_taus(n: int) -> list[float]:
    """Two workers per power of two up to 16, repeating: 1,1,2,2,4,4,8,8,16,16,1,1,... (the paper's
    for n=10; with more clients the spread stays 16×, not 2^(n/2))."""
    return [float(2 ** ((i // 2) % 5)) for i in range(n)]


@dataclass
class RunSpec:
    """One run: the task and its partition, the strategy and α, time, budget and outputs."""

    task: str = _f("mnist", f"the learning task: {' | '.join(TASKS)}")
    strategy: str = _f("rescaled", "the method (a name of fl_rescaled.strategies.STRATEGIES)")
    lr: float | None = _f(None, "the cycle stepsize α (default: the strategy's, 1)")
    options: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})
    delays: str = _f("fixed", f"compute times: {' | '.join(DELAY_KINDS)} (exactly τ_i, or Exp(mean τ_i) draws)")
    taus: list[float] | None = _f(None, "compute time per client (default 1,1,2,2,4,4,8,8,16,16, repeating)")
    num_clients: int | None = _f(None, "number of clients (default len(taus), else 10)")
    budget: float = _f(10000.0, "time budget in time units (simulated; on the wall clock seconds / time-unit)")
    seed: int = _f(0, "seeds the partition, the model, the delays and every client's minibatches")
    eval_every: float | None = _f(None, "evaluation period in time units (default budget/200); costs no simulated time")
    batch_size: int = _f(64, "minibatch size")
    dirichlet_alpha: float = _f(0.0, "label skew of the MNIST partition; 0 gives one class per client")
    data_dir: str | None = _f(None, "a folder with the four MNIST IDX files (else the cache, or the PyPI copy)")
    quad_a: list[float] | None = _f(None, "quadratic curvatures a_i of F_i(x) = a_i ‖x − b_i‖² (default 1)")
    quad_b: list[float] | None = _f(None, "quadratic minimisers b_i (default 0, 1, 2, ...)")
    quad_dim: int = _f(1, "dimension of the quadratic task")
    quad_x0: float = _f(0.0, "starting point of the quadratic task (every coordinate)")
    noise: float = _f(0.0, "Gaussian gradient noise σ of the quadratic task")
    local_steps: int = _f(1, "local SGD steps per job when the strategy takes model replies (H)")
    local_lr: float | None = _f(None, "local SGD learning rate (default: the α convention, see the README)")
    prox: float = _f(0.0, "proximal weight ρ of local training (FedAsync's regulariser)")
    clock: str = _f("virtual", "virtual (simulated time) | wall (replies in arrival order, τ estimated online)")
    time_unit: float = _f(1.0, "wall clock: seconds per time unit (budget, τ and emulated delays use it)")
    emulate: str = _f("", "wall clock: fixed | exponential: clients sleep τ_i time units per job")
    tau_estimator: str = _f("interval", "wall clock: interval (between deliveries) | compute (reported by clients)")
    ttl: float = _f(3600.0, "seconds a job may take before it counts as lost")
    workers: int | None = _f(None, "in-process Grid, virtual clock: threads that run the evaluations while the "
                                   "event loop goes on, and with --ahead the jobs in flight too (default: the "
                                   "machine's cores; 1: everything in turn); the trajectory is the same for any value")
    ahead: bool = _f(False, "compute the jobs in flight on the --workers threads as soon as they are sent (pays off "
                            "when a job's work releases the GIL, as a CNN's local epochs do; the MNIST MLP's one "
                            "minibatch gradient does not: see the README)")
    torch_threads: int = _f(1, "torch threads per job and per evaluation (the same for any --workers, so "
                               "trajectories match; the paper study ran with 1)")
    out: str | None = _f(None, "a folder for the CSV, PNG and final model of the run (and its checkpoint)")
    checkpoint_every: float | None = _f(None, "write the run's whole state every this many time units, atomically, "
                                              "to <out>/run.ckpt (or to the --resume folder)")
    resume: str | None = _f(None, "a folder holding a run.ckpt of this same run: go on from it (give the same "
                                  "settings again; a checkpoint of another run is refused)")
    progress: bool = field(default=False, metadata={"cli": False})
    extra: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})

    def resolved(self) -> RunSpec:
        """Fill defaults that depend on other fields and validate; raises ValueError."""
        s = dataclasses.replace(self, options=dict(self.options))
        _choice("task", s.task, TASKS)
        _choice("delays", s.delays, DELAY_KINDS)
        _choice("clock", s.clock, ("virtual", "wall"))
        _choice("emulate", s.emulate, ("", "fixed", "exponential"))
        _choice("tau-estimator", s.tau_estimator, ("interval", "compute"))
        weights = s.options.get("weights")
        if s.num_clients is None:
            guesses = [s.taus, s.quad_b if s.task == "quadratic" else None, weights]
            s.num_clients = next((len(g) for g in guesses if g), 10)
        if not 1 <= s.num_clients <= MAX_CLIENTS:
            raise ValueError(f"--num-clients must be in 1..{MAX_CLIENTS:,}, got {s.num_clients}")
        if s.taus is None:
            s.taus = default_taus(s.num_clients)
        if len(s.taus) != s.num_clients:
            raise ValueError(f"--taus has {len(s.taus)} values for {s.num_clients} clients")
        tau_stats(s.taus)  # positive and finite
        for name in ("budget", "time_unit", "ttl"):
            _positive(name, getattr(s, name))
        if s.checkpoint_every is not None and s.out is None and s.resume is None:
            raise ValueError("--checkpoint-every needs --out (or --resume): the folder the checkpoint goes to")
        for name in ("eval_every", "local_lr", "checkpoint_every"):
            if getattr(s, name) is not None:
                _positive(name, getattr(s, name))
        if s.workers is None:
            s.workers = available_cores()
        for name, low, high in INT_RANGES:
            if not low <= getattr(s, name) <= high:
                raise ValueError(f"--{name.replace('_', '-')} must be in {low}..{high:,}, got {getattr(s, name)}")
        if s.eval_every is not None and s.budget / s.eval_every > MAX_EVALUATIONS:
            raise ValueError(f"--eval-every {s.eval_every:g} asks for more than {MAX_EVALUATIONS:,} evaluations "
                             f"of a {s.budget:g}-unit budget")
        for name in ("dirichlet_alpha", "noise", "prox"):
            if not getattr(s, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be non-negative")
        if weights is not None and len(weights) != s.num_clients:
            raise ValueError(f"--rescaled-weights has {len(weights)} values for {s.num_clients} clients")
        if s.task == "quadratic":
            s.quad_a = s.quad_a if s.quad_a is not None else [1.0] * s.num_clients
            s.quad_b = s.quad_b if s.quad_b is not None else [float(i) for i in range(s.num_clients)]
            if len(s.quad_a) != s.num_clients or len(s.quad_b) != s.num_clients:
                raise ValueError("--quad-a and --quad-b need one value per client")
            if any(not a > 0 for a in s.quad_a):
                raise ValueError("--quad-a values must be positive")
        return s

    def checkpoint_path(self) -> Path | None:
        folder = self.resume or (self.out if self.checkpoint_every is not None else None)
        return None if folder is None else Path(folder) / "run.ckpt"

    def fingerprint(self) -> str:
        """What identifies this run's trajectory (not where it writes, nor how many threads compute it)."""
        skip = {"out", "progress", "extra", "workers", "ahead", "checkpoint_every", "resume"}
        what = {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()

    def task_config(self) -> dict[str, Any]:
        """The task's config keys (what every job's ``task`` spec carries)."""
        cfg: dict[str, Any] = {"task": self.task, "seed": self.seed, "num-partitions": self.num_clients,
                               "batch-size": self.batch_size}
        if self.options.get("weights") is not None:
            cfg["weights"] = list(self.options["weights"])
        if self.task == "mnist":
            cfg["dirichlet-alpha"] = self.dirichlet_alpha
            if self.data_dir:
                cfg["data-dir"] = str(self.data_dir)
        else:
            cfg.update({"quad-a": list(self.quad_a or []), "quad-b": list(self.quad_b or []),
                        "quad-dim": self.quad_dim, "noise": self.noise})
        return cfg


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # (not on Linux)
        return max(1, os.cpu_count() or 1)


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(c or repr(c) for c in choices)}")


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value!r}")


@dataclass(frozen=True)
class SpecField:
    """A ``RunSpec`` field as the command line and the run config see it."""

    name: str  # "eval_every"
    key: str  # "eval-every"
    kind: str  # "float" | "int" | "str" | "bool" | "floats"
    optional: bool
    default: Any
    help: str

    def parse(self, text: str) -> Any:
        """The value of a command-line or run-config string; raises ValueError with a one-line reason."""
        return parse_value(self.kind, self.optional, self.key, text)


def spec_fields() -> list[SpecField]:
    """The fields the command line and the run config set (all but ``options``, ``progress``, ``extra``)."""
    hints = typing.get_type_hints(RunSpec)
    out = []
    for f in dataclasses.fields(RunSpec):
        if not f.metadata.get("cli", True):
            continue
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = type(None) in args
        base = next((a for a in args if a is not type(None)), hint)
        kind = "floats" if typing.get_origin(base) is list else {bool: "bool", float: "float", int: "int"}.get(base, "str")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(SpecField(f.name, f.name.replace("_", "-"), kind, optional, default, f.metadata["help"]))
    return out
