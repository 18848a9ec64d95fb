"""``RunSpec``: everything that defines one simulated run, declared once.

Each field is a setting (``fl_rescaled.settings``): its description and allowed values are declared
with it; the command line (``--eval-every``), the Flower run config (``eval-every = 100.0``) and the
experiment runner all read the fields from here, so a default lives in one place. The client
manager's settings are a field too (``manager``, a ``ManagerSettings``). The strategy's own options are not fields: they are the keyword
arguments of its constructor, collected in ``options`` (see ``fl_rescaled.strategies.options``);
``lr`` (the cycle stepsize α) is a field because every run, sweep and file name has one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .availability import KINDS as AVAILABILITY_KINDS
from .clock import DELAY_KINDS, tau_stats
from .data.partition import SCHEMES as PARTITION_SCHEMES
from .delays import TAU_PROFILES, tau_profile
from .manager import ManagerSettings
from .settings import Setting, available_cores, of_dataclass, setting
from .tasks import TASKS


#: The most clients a run may have (each one has its books and its τ; a million is far beyond the
#: largest study here, and a typo such as --num-clients 1e9 should not exhaust memory first).
MAX_CLIENTS = 1_000_000
#: The most evaluations a run may ask for (``budget / eval_every``).
MAX_EVALUATIONS = 1_000_000
#: The most replies a simulated run may expect (budget × the replies per time unit): beyond, the run
#: would not end in any useful time (``--budget 1e300``, ``--taus 1e-300,1``).
MAX_EVENTS = 1_000_000_000
#: A wall-clock run's budget in seconds (budget × time unit): at least a millisecond (a budget that
#: ends before a reply can arrive), at most a year (one that never ends).
WALL_SECONDS = (1e-3, 365 * 86400.0)


def default_taus(n: int) -> list[float]:
    """Two workers per power of two up to 16, repeating: 1,1,2,2,4,4,8,8,16,16,1,1,... (the paper's
    for n=10; with more clients the spread stays 16×, not 2^(n/2))."""
    powers = [1.0, 2.0, 4.0, 8.0, 16.0]  # (five float objects shared by every client: a population is large)
    return [powers[(i // 2) % 5] for i in range(n)]


@dataclass
class RunSpec:
    """One run: the task and its partition, the strategy and α, time, budget and outputs."""

    task: str = setting("mnist", "the learning task", choices=TASKS)
    strategy: str = setting("rescaled", "the method (a name of fl_rescaled.strategies.STRATEGIES)")
    lr: float | None = setting(None, "the cycle stepsize α (default: the strategy's, 1)", positive=True)
    options: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})
    delays: str = setting("fixed", "compute times of mean τ_i: exactly τ_i (fixed), or exponential, lognormal "
                                   "(--delay-sigma) or pareto (--delay-alpha) draws, or a trace file (--delay-trace)",
                          choices=DELAY_KINDS)
    delay_sigma: float = setting(0.5, "lognormal compute times: the spread σ of log τ", low=0, high=10)
    delay_alpha: float = setting(3.0, "pareto compute times: the tail index α (> 1; smaller, heavier)", low=1.000001,
                                 high=1000)
    delay_trace: str | None = setting(None, "a compute-time trace: CSV client,duration or JSON (docs/population.md)")
    speed_drift: float | None = setting(None, "speeds that change: every job's time × (1 + rate · t), t its start")
    speed_switch: list[float] | None = setting(None, "speeds that change: at,factor[,fraction]: jobs that start at or "
                                                     "after time at take factor × as long (on that fraction of clients)")
    taus: list[float] | None = setting(None, "mean compute time per client (default: --tau-profile)", positive=True)
    tau_profile: str = setting("powers", "the clients' τ when --taus is not given: powers (1,1,2,2,4,4,8,8,16,16 "
                                         "repeating), lognormal (mean 1, --tau-spread), uniform (1 to 16), constant 1",
                               choices=TAU_PROFILES)
    tau_spread: float = setting(1.0, "lognormal --tau-profile: the spread of log τ", low=0, high=10)
    availability: str = setting("always", "when clients are online: always, daily (a cycle of "
                                          "--availability-period with a random phase per client, online "
                                          "--availability-fraction of it), or a trace file (--availability-trace)",
                                choices=AVAILABILITY_KINDS)
    availability_period: float = setting(24.0, "daily availability: the cycle's length in time units", positive=True)
    availability_fraction: float = setting(0.5, "daily availability: the share of each cycle a client is online",
                                           low=0, high=1)
    availability_trace: str | None = setting(None, "an availability trace: CSV client,start,end or JSON "
                                                   "(docs/population.md)")
    num_clients: int | None = setting(None, "number of clients (default len(taus), else 10)", low=1, high=MAX_CLIENTS)
    budget: float = setting(10000.0, "time budget in time units (simulated; on the wall clock seconds / time-unit)",
                            positive=True)
    num_trainings: int | None = setting(None, "also stop after this many client trainings (FedAvg's rounds × clients "
                                              "per round; a reply accepted or rejected counts, a lost job does "
                                              "not), if the time budget is not spent first", low=1,
                                        high=MAX_EVENTS)
    seed: int = setting(0, "seeds the partition, the model, the delays and every client's minibatches",
                        low=0, high=2**63 - 1)
    eval_every: float | None = setting(None, "evaluation period in time units (default budget/200); costs no "
                                             "simulated time", positive=True)
    batch_size: int = setting(64, "minibatch size", low=1, high=1_000_000)
    dirichlet_alpha: float = setting(0.0, "label skew of the MNIST partition; 0 gives one class per client", low=0)
    partition: str = setting("split", "how MNIST is split: split (each digit among the clients in Dirichlet "
                                      "proportions, every client cut to the smallest) or mix (each client draws a "
                                      "Dirichlet digit mix, all clients the same size)", choices=PARTITION_SCHEMES)
    data_dir: str | None = setting(None, "a folder with the four MNIST IDX files (else the cache, or the PyPI copy)")
    quad_a: list[float] | None = setting(None, "quadratic curvatures a_i of F_i(x) = a_i ‖x − b_i‖² (default 1)",
                                         positive=True)
    quad_b: list[float] | None = setting(None, "quadratic minimisers b_i (default 0, 1, 2, ...)")
    quad_dim: int = setting(1, "dimension of the quadratic task", low=1, high=100_000_000)
    quad_x0: float = setting(0.0, "starting point of the quadratic task (every coordinate)")
    noise: float = setting(0.0, "Gaussian gradient noise σ of the quadratic task", low=0)
    local_steps: int = setting(1, "local SGD steps per job when the strategy takes model replies (H)",
                               low=1, high=1_000_000)
    local_lr: float | None = setting(None, "local SGD learning rate (default: the α convention, see the README)",
                                     positive=True)
    prox: float = setting(0.0, "proximal weight ρ of local training (FedAsync's regulariser)", low=0)
    clock: str = setting("virtual", "virtual (simulated time) | wall (replies in arrival order, τ estimated online)",
                         choices=("virtual", "wall"))
    time_unit: float = setting(1.0, "wall clock: seconds per time unit (budget, τ and emulated delays use it)",
                               positive=True)
    emulate: str = setting("", "wall clock: fixed | exponential: clients sleep τ_i time units per job",
                           choices=("", "fixed", "exponential"))
    ttl: float = setting(3600.0, "seconds a job may take before it counts as lost", positive=True)
    workers: int | None = setting(None, "in-process Grid, virtual clock: threads that run the evaluations while the "
                                        "event loop goes on, and with --ahead the jobs in flight too; from 2, the "
                                        "MNIST jobs go to a second process (default: the machine's cores; 1: "
                                        "everything in turn); the trajectory is the same for any value",
                                  low=1, high=1024)
    ahead: bool = setting(False, "compute the jobs in flight on the --workers threads as soon as they are sent (pays "
                                 "off when a job's work releases the GIL, as a CNN's local epochs do; the MNIST MLP's "
                                 "one minibatch gradient does not: see the README)")
    no_batch: bool = setting(False, "in-process Grid, virtual clock: compute the jobs in flight one by one instead of "
                                    "in lazy batches (same results up to float rounding; see docs/performance.md)")
    device: str = setting("cpu", "where the MNIST task's jobs compute: cpu | cuda | auto (cuda when available)",
                          choices=("cpu", "cuda", "auto"))
    torch_threads: int = setting(1, "torch threads per job and per evaluation (the same for any --workers, so "
                                    "trajectories match; the paper study ran with 1)", low=1, high=1024)
    dp_noise_multiplier: float | None = setting(None, "differential privacy (docs/privacy.md): the noise multiplier z; "
                                                      "every applied aggregate gets Gaussian noise of std z × "
                                                      "--dp-clipping-norm (none: no DP)", low=0, high=1e6)
    dp_clipping_norm: float | None = setting(None, "differential privacy: every client update is clipped to this L2 "
                                                   "norm C (needed with --dp-noise-multiplier)", positive=True)
    dp_delta: float | None = setting(None, "differential privacy: the δ of each client's reported (ε, δ) (default "
                                           "min(1e-5, 1/N^1.1) for N clients)", positive=True, high=0.5)
    dp_target_epsilon: float | None = setting(None, "differential privacy: each client's budget ε at δ; a client "
                                                    "whose ε would exceed it gets no more jobs", positive=True, high=1e6)
    dp_target_quantile: float | None = setting(None, "differential privacy: adaptive clipping (Andrew et al. 2021): the "
                                                     "clipping norm follows this quantile of the update norms, "
                                                     "privately estimated, from --dp-clipping-norm (none: fixed)",
                                               positive=True, high=1)
    out: str | None = setting(None, "a folder for the CSV, PNG and final model of the run (and its checkpoint)")
    checkpoint_every: float | None = setting(None, "write the run's whole state every this many time units, "
                                                   "atomically, to <out>/run.ckpt (or to the --resume folder)",
                                             positive=True)
    resume: str | None = setting(None, "a folder holding a run.ckpt of this same run: go on from it (give the same "
                                       "settings again; a checkpoint of another run is refused)")
    manager: ManagerSettings = field(default_factory=ManagerSettings, metadata={"cli": False})
    #: The checkpoint's file name in its folder; None: ``run.ckpt``, and ``--resume`` needs it. A command
    #: that runs several strategies names one per strategy (``run-vanilla.ckpt``), each resumed if present.
    checkpoint_name: str | None = field(default=None, metadata={"cli": False})
    progress: bool = field(default=False, metadata={"cli": False})
    extra: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})

    def resolved(self) -> RunSpec:
        """Fill defaults that depend on other fields and validate; raises ValueError."""
        s = dataclasses.replace(self, options=dict(self.options))
        for setting_ in run_settings():
            setting_.check(getattr(s, setting_.name))
        weights = s.options.get("weights")
        if s.num_clients is None:
            guesses = [s.taus, s.quad_b if s.task == "quadratic" else None, weights]
            s.num_clients = next((len(g) for g in guesses if g), 10)
        if s.taus is None:
            s.taus = default_taus(s.num_clients) if s.tau_profile == "powers" else tau_profile(
                s.num_clients, s.tau_profile, seed=s.seed, spread=s.tau_spread).tolist()
        if len(s.taus) != s.num_clients:
            raise ValueError(f"--taus has {len(s.taus)} values for {s.num_clients} clients")
        with np.errstate(all="ignore"):  # (τ near the float limits: refused below, without numpy's warnings)
            tau_stats(s.taus)  # positive and finite
        if s.checkpoint_every is not None and s.out is None and s.resume is None:
            raise ValueError("--checkpoint-every needs --out (or --resume): the folder the checkpoint goes to")
        if s.workers is None:
            s.workers = available_cores()
        if s.eval_every is not None and s.budget / s.eval_every > MAX_EVALUATIONS:
            raise ValueError(f"--eval-every {s.eval_every:g} asks for more than {MAX_EVALUATIONS:,} evaluations "
                             f"of a {s.budget:g}-unit budget")
        if weights is not None and len(weights) != s.num_clients:
            raise ValueError(f"--rescaled-weights has {len(weights)} values for {s.num_clients} clients")
        if s.task == "quadratic":  # (left out, a_i = 1 and b_i = i: the task makes them, jobs stay small)
            if any(v is not None and len(v) != s.num_clients for v in (s.quad_a, s.quad_b)):
                raise ValueError("--quad-a and --quad-b need one value per client")
        if s.delays == "trace" and not s.delay_trace:
            raise ValueError("--delays trace needs --delay-trace FILE")
        if s.availability == "trace" and not s.availability_trace:
            raise ValueError("--availability trace needs --availability-trace FILE")
        switch = s.speed_switch
        if switch is not None and (len(switch) not in (2, 3) or not switch[1] > 0
                                   or not all(0 <= f <= 1 for f in switch[2:])):
            raise ValueError("--speed-switch: at,factor or at,factor,fraction (factor > 0, fraction in [0, 1])")
        return s

    def checkpoint_path(self) -> Path | None:
        folder = self.resume or (self.out if self.checkpoint_every is not None else None)
        return None if folder is None else Path(folder) / (self.checkpoint_name or "run.ckpt")

    def prepare_out(self) -> None:
        """Create the ``out`` folder (before any work) and check it takes files; ValueError, one line."""
        if self.out is None:
            return
        folder = Path(self.out)
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--out {self.out} is a file; name a folder (it is created if missing)")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--out {self.out}: cannot create the folder ({exc.strerror or exc})") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"--out {self.out}: the folder is not writable")

    def output_stem(self, lr: float) -> str:
        """The name of the run's files in ``out``: task, strategy, α (every digit) and seed, then eight
        hex digits of ``fingerprint``, so runs that differ in any other setting write other files."""
        alpha = repr(float(lr))
        alpha = alpha[:-2] if alpha.endswith(".0") else alpha
        return f"{self.task}_{self.strategy}_lr{alpha}_seed{self.seed}_{self.fingerprint()[:8]}"

    def fingerprint(self) -> str:
        """What identifies this run's trajectory (not where it writes, nor how many threads compute it)."""
        skip = {"out", "progress", "extra", "workers", "ahead", "checkpoint_every", "resume", "checkpoint_name",
                "no_batch", "device"}
        what = {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
        if what["num_trainings"] is None:  # (unset, a run is the one it was before the setting existed)
            del what["num_trainings"]
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()

    def task_config(self) -> dict[str, Any]:
        """The task's config keys (what every job's ``task`` spec carries)."""
        cfg: dict[str, Any] = {"task": self.task, "seed": self.seed, "num-partitions": self.num_clients,
                               "batch-size": self.batch_size}
        if self.options.get("weights") is not None:
            cfg["weights"] = list(self.options["weights"])
        if self.task == "mnist":
            cfg["dirichlet-alpha"] = self.dirichlet_alpha
            if self.partition != "split":  # (the default is left out: the jobs' task text stays as it was)
                cfg["partition"] = self.partition
            if self.data_dir:
                cfg["data-dir"] = str(self.data_dir)
        else:
            cfg.update({"quad-dim": self.quad_dim, "noise": self.noise})
            if self.quad_a is not None:
                cfg["quad-a"] = list(self.quad_a)
            if self.quad_b is not None:
                cfg["quad-b"] = list(self.quad_b)
        return cfg


def bounded(s: RunSpec, strategy: Any) -> None:
    """Refuse a budget that no run could use up or end: too short to evaluate or see a reply, or
    (more than ``MAX_EVENTS`` replies expected, or a wall-clock run of more than a year) unbounded."""
    if s.eval_every is None and not s.budget / 200.0 > 0:
        raise ValueError(f"--budget {s.budget:g} is too small to split into evaluation periods")
    if s.clock == "wall":
        seconds = s.budget * s.time_unit
        if not WALL_SECONDS[0] <= seconds <= WALL_SECONDS[1]:
            raise ValueError(f"--budget {s.budget:g} × --time-unit {s.time_unit:g} is {seconds:.3g} s of wall "
                             f"clock; a run needs between {WALL_SECONDS[0]:g} s and a year")
        return
    events = expected_replies(s, strategy.jobs_per_node, strategy.population.slots(len(s.taus)))
    if events > MAX_EVENTS:
        flag = speedup(s)[1]  # (the speed change that shortens the jobs, if one does)
        raise ValueError(f"--budget {s.budget:g} with τ from {min(s.taus):g}{' and ' + flag if flag else ''} "
                         f"asks for about {events:.3g} replies, more than {MAX_EVENTS:.0e}: the run would not end; "
                         f"lower --budget or raise --taus{' or ' + flag if flag else ''}")


def expected_replies(s: RunSpec, jobs_per_node: int, slots: int) -> float:
    """About how many replies a simulated run with every client busy gets in its budget: budget × the
    jobs in flight × their mean rate (Σ 1/τ_i for ``jobs_per_node`` jobs per client; with C < n
    ``slots``, C × the mean 1/τ_i)."""
    n = len(s.taus)
    with np.errstate(over="ignore", divide="ignore"):
        rate = float(np.sum(1.0 / np.asarray(s.taus, np.float64)))
    rate = rate * slots / n if slots < n else rate * jobs_per_node
    return s.budget * rate * speedup(s)[0]


def speedup(s: RunSpec) -> tuple[float, str | None]:
    """How many times shorter speeds that change can make the jobs (a drift down to 1e-3 ×, speeds.Drift's
    floor; a switch to ``factor`` ×), and the flag that does it most (None: neither does)."""
    faster, flag = 1.0, None
    if s.speed_drift is not None and s.speed_drift < 0:
        faster, flag = 1e3, "--speed-drift"
    if s.speed_switch is not None and len(s.speed_switch) >= 2 and 0 < s.speed_switch[1] < 1 / faster:
        faster, flag = 1.0 / s.speed_switch[1], "--speed-switch"
    return faster, flag


def reachable(s: RunSpec, strategy: Any) -> None:
    """Refuse settings that cannot make one update within the budget, where that is known before the
    run: fixed compute times on the virtual clock, where client i delivers at most ⌊budget / τ_i⌋
    replies per job it holds (availability and concurrency only lower that)."""
    if s.clock != "virtual" or s.delays != "fixed" or s.speed_drift is not None or s.speed_switch is not None:
        return
    taus = np.asarray(s.taus, np.float64)
    most = np.floor(s.budget / taus) * strategy.jobs_per_node  # replies each client can deliver at most
    if most.sum() == 0:
        raise ValueError(f"--budget {s.budget:g} is shorter than the fastest client's compute time "
                         f"(τ = {taus.min():g}): no reply can arrive")
    if strategy.name == "fedbuff" and strategy.buffer_for(taus.size) > most.sum():
        raise ValueError(f"--fedbuff-buffer-size {strategy.buffer_for(taus.size)} needs that many replies for one "
                         f"update; the budget allows at most {int(most.sum()):,}")
    if strategy.name == "malenia" and s.availability == "always":
        n = taus.size
        if (most == 0).any():
            raise ValueError(f"--budget {s.budget:g}: a Malenia round waits for every client, and the slowest "
                             f"(τ = {taus.max():g}) cannot deliver in it")
        if strategy.S is not None and n / np.sum(1.0 / most) <= strategy.S / n:
            raise ValueError(f"--malenia-s {strategy.S:g}: a round closes once the harmonic mean of the clients' "
                             f"gradient counts exceeds S/n = {strategy.S / n:.3g}; the budget allows at most "
                             f"{n / np.sum(1.0 / most):.3g}")


def _only(what: str, test: Callable[[RunSpec, str, set[str]], bool], *names: str) -> dict[str, tuple[str, Any]]:
    return {name: (what, test) for name in names}


#: Settings that apply to some runs only: name → (what they apply to, does it apply to (spec, the
#: strategy, the settings given)?). The strategy's own options are not here; its common ones may be.
APPLIES_TO: dict[str, tuple[str, Any]] = {
    **_only("the quadratic task", lambda s, st, g: s.task == "quadratic", "quad_a", "quad_b", "quad_dim", "quad_x0",
            "noise"),
    **_only("the mnist task", lambda s, st, g: s.task == "mnist", "dirichlet_alpha", "data_dir", "batch_size",
            "torch_threads", "device"),
    **_only("the wall clock (--clock wall)", lambda s, st, g: s.clock == "wall", "time_unit", "emulate",
            "tau_estimator", "node_refresh"),
    **_only("the virtual clock", lambda s, st, g: s.clock == "virtual", "workers", "ahead", "no_batch", "delays",
            "speed_drift", "speed_switch", "availability"),
    **_only("--delays lognormal", lambda s, st, g: s.clock == "virtual" and s.delays == "lognormal", "delay_sigma"),
    **_only("--delays pareto", lambda s, st, g: s.clock == "virtual" and s.delays == "pareto", "delay_alpha"),
    **_only("--delays trace", lambda s, st, g: s.clock == "virtual" and s.delays == "trace", "delay_trace"),
    **_only("runs without --taus", lambda s, st, g: "taus" not in g, "tau_profile"),
    **_only("--tau-profile lognormal without --taus", lambda s, st, g: "taus" not in g and s.tau_profile == "lognormal",
            "tau_spread"),
    **_only("--availability daily", lambda s, st, g: s.clock == "virtual" and s.availability == "daily",
            "availability_period", "availability_fraction"),
    **_only("--availability trace", lambda s, st, g: s.clock == "virtual" and s.availability == "trace",
            "availability_trace"),
    **_only("strategies taking model replies (--reply model)", lambda s, st, g: st.reply == "model", "local_steps",
            "local_lr", "prox"),
    **_only("populations with fewer training at a time than clients (--concurrency or --fraction-train)",
            lambda s, st, g: st.population.slots(s.num_clients) < s.num_clients, "selection"),
}


def ignored(s: RunSpec, strategy: Any, given: set[str]) -> set[str]:
    """The settings among ``given`` (names) that do not apply to the run ``s`` with ``strategy`` (built
    from it): they change nothing, which a user who gave them should hear."""
    return {name for name in given if name in APPLIES_TO and not APPLIES_TO[name][1](s, strategy, given)}


def ignored_lines(runs: list[tuple[RunSpec, Any]], given: set[str], spell: Callable[[str], str]) -> list[str]:
    """One warning line per setting among ``given`` that changes nothing in any of ``runs`` ((spec,
    strategy) pairs), its name written by ``spell`` (the command line's ``--time-unit``, the run
    config's ``'time-unit'``): the one rule of ``run_sim.py``'s and the ServerApp's warnings."""
    unused = set.intersection(*(ignored(spec, strategy, given) for spec, strategy in runs))
    return [f"{spell(name)} is ignored: it applies to {APPLIES_TO[name][0]} only" for name in sorted(unused)]


def run_settings() -> list[Setting]:
    """The run's settings: ``RunSpec``'s fields (those the command line and the run config set)."""
    return of_dataclass(RunSpec, "run")


def manager_settings() -> list[Setting]:
    """The client manager's settings (``ManagerSettings``'s fields)."""
    return of_dataclass(ManagerSettings, "manager")
