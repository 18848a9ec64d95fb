"""One simulated run, described by a ``RunSpec``: shared by ``run_sim.py`` and the ServerApp.

``run(spec)`` builds the task, the strategy, the virtual clock and (by default) the in-process
Grid, runs the strategy's asynchronous loop, writes the CSV/PNG outputs and returns a flat dict
of results (the JSON printed by ``run_sim.py --json``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.serverapp import Grid

from .clock import DELAY_KINDS, DelayModel, VirtualClock, WallClock, tau_stats
from .checkpoints import save_checkpoint
from .metrics import plot_curves, write_history_csv
from .stepsizes import vanilla_stepsize
from .tasks import TASKS, get_task, task_spec


def default_taus(n: int) -> list[float]:
    """Harmonic compute times, two workers per power of two: 1,1,2,2,4,4,... (the paper's for n=10)."""
    return [float(2 ** (i // 2)) for i in range(n)]


@dataclass
class RunSpec:
    """Everything that defines one run (the command line's flags, the app's run_config)."""

    task: str = "mnist"
    strategy: str = "rescaled"
    lr: float = 1.0
    delays: str = "fixed"
    taus: list[float] | None = None
    num_clients: int | None = None  # default: len(taus), else len(quad_b), else 10
    budget: float = 1000.0
    seed: int = 0
    eval_every: float | None = None
    weights: list[float] | None = None
    batch_size: int = 64
    dirichlet_alpha: float = 0.0
    data_dir: str | None = None
    quad_a: list[float] | None = None
    quad_b: list[float] | None = None
    quad_dim: int = 1
    quad_x0: float = 0.0
    noise: float = 0.0
    delay_rule: str = "inverse"
    # options of the comparison methods (algorithms.md; defaults there)
    malenia_s: float | None = None  # None: every worker ≥ 1 gradient per round
    ringleader_restart: bool = False  # the public code's "restart on the current model"
    concurrency: int | None = None  # Concurrent ASGD's τ_C (default n)
    local_steps: int = 1  # FedAsync H / FedBuff Q
    local_lr: float | None = None  # local training's learning rate (default: the α convention)
    reply: str | None = None  # "gradient" | "model" (default: the method's)
    fedasync_mixing: float = 0.6
    fedasync_staleness: str = "polynomial"
    fedasync_a: float = 0.5
    fedasync_b: int = 4
    fedasync_prox: float = 0.0
    fedbuff_buffer: int = 3
    fedbuff_server_lr: float = 1.0
    staleness_exponent: float = 0.5  # FedBuff's p
    # transport and time (Flower runtimes, deployment)
    clock: str = "virtual"  # "virtual" (simulated time) | "wall" (arrival order, online τ estimates)
    time_unit: float = 1.0  # wall clock: seconds per time unit (budget, τ and emulated delays use it)
    emulate: str = ""  # wall clock: "" | "fixed" | "exponential": clients sleep τ_i time units per job
    tau_estimator: str = "interval"  # wall clock: "interval" (between deliveries) | "compute" (reported)
    ttl: float = 3600.0  # seconds a job may take before it counts as lost
    jobs_per_node: int = 1  # wall clock: jobs kept in flight per node
    out: str | None = None
    progress: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def resolved(self) -> RunSpec:
        """Fill defaults that depend on other fields and validate; raises ValueError."""
        from fl_rescaled.strategies import STRATEGIES

        s = RunSpec(**{**asdict(self)})
        if s.task not in TASKS:
            raise ValueError(f"unknown task {s.task!r}; choose one of {', '.join(TASKS)}")
        if s.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {s.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if s.delays not in DELAY_KINDS:
            raise ValueError(f"unknown delays {s.delays!r}; choose one of {', '.join(DELAY_KINDS)}")
        if s.num_clients is None:
            guesses = [s.taus, s.quad_b if s.task == "quadratic" else None, s.weights]
            s.num_clients = next((len(g) for g in guesses if g), 10)
        if s.num_clients < 1:
            raise ValueError("--num-clients must be at least 1")
        if s.taus is None:
            s.taus = default_taus(s.num_clients)
        if len(s.taus) != s.num_clients:
            raise ValueError(f"--taus has {len(s.taus)} values for {s.num_clients} clients")
        if any(not (t > 0 and math.isfinite(t)) for t in s.taus):
            raise ValueError("every compute time in --taus must be positive")
        if not (s.lr > 0 and math.isfinite(s.lr)):
            raise ValueError("--lr (α) must be positive")
        if not (s.budget > 0 and math.isfinite(s.budget)):
            raise ValueError("--budget must be positive")
        if s.eval_every is not None and not s.eval_every > 0:
            raise ValueError("--eval-every must be positive")
        if s.batch_size < 1:
            raise ValueError("--batch-size must be at least 1")
        if s.dirichlet_alpha < 0:
            raise ValueError("--dirichlet-alpha must be non-negative")
        if s.noise < 0:
            raise ValueError("--noise must be non-negative")
        if s.weights is not None:
            if len(s.weights) != s.num_clients:
                raise ValueError(f"--weights has {len(s.weights)} values for {s.num_clients} clients")
            if any(w < 0 for w in s.weights) or abs(sum(s.weights) - 1.0) > 1e-6:
                raise ValueError("--weights must be non-negative and sum to 1")
        if s.task == "quadratic":
            if s.quad_a is None:
                s.quad_a = [1.0] * s.num_clients
            if s.quad_b is None:
                s.quad_b = [float(i) for i in range(s.num_clients)]
            if len(s.quad_a) != s.num_clients or len(s.quad_b) != s.num_clients:
                raise ValueError("--quad-a and --quad-b need one value per client")
            if any(a <= 0 for a in s.quad_a):
                raise ValueError("--quad-a values must be positive")
            if s.quad_dim < 1:
                raise ValueError("--quad-dim must be at least 1")
        if s.clock not in ("virtual", "wall"):
            raise ValueError("--clock must be virtual or wall")
        if s.emulate not in ("", "fixed", "exponential"):
            raise ValueError("--emulate must be fixed or exponential")
        if s.tau_estimator not in ("interval", "compute"):
            raise ValueError("--tau-estimator must be interval or compute")
        if not (s.time_unit > 0 and s.ttl > 0 and s.jobs_per_node >= 1):
            raise ValueError("--time-unit and --ttl must be positive and --jobs-per-node at least 1")
        if s.concurrency is not None and not 1 <= s.concurrency <= s.num_clients:
            raise ValueError(f"--concurrency must be in 1..{s.num_clients}")
        make_strategy(s)  # the strategy's own checks of its options
        return s

    def task_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "task": self.task,
            "seed": self.seed,
            "num-partitions": self.num_clients,
            "batch-size": self.batch_size,
        }
        if self.weights is not None:
            cfg["weights"] = list(self.weights)
        if self.task == "mnist":
            cfg["dirichlet-alpha"] = self.dirichlet_alpha
            if self.data_dir:
                cfg["data-dir"] = str(self.data_dir)
        else:
            cfg.update({"quad-a": list(self.quad_a or []), "quad-b": list(self.quad_b or []),
                        "quad-dim": self.quad_dim, "noise": self.noise})
        return cfg


def make_strategy(spec: RunSpec):
    """The strategy a spec names, with its options (no federated evaluation: the project's
    ClientApp has no ``@app.evaluate``; runs are scored centrally)."""
    import fl_rescaled.strategies as S

    common = {"lr": spec.lr, "fraction_evaluate": 0.0, "jobs_per_node": spec.jobs_per_node}
    if spec.reply is not None:
        common["reply"] = spec.reply
    name = spec.strategy
    if name in ("malenia", "ringleader", "minibatch", "concurrent"):
        del common["jobs_per_node"]
    if name == "rescaled":
        return S.RescaledASGD(weights=spec.weights, **common)
    if name == "delay-adaptive":
        return S.DelayAdaptiveASGD(rule=spec.delay_rule, **common)
    if name == "malenia":
        return S.MaleniaSGD(S=spec.malenia_s, **common)
    if name == "ringleader":
        return S.RingleaderASGD(restart_on_current=spec.ringleader_restart, **common)
    if name == "concurrent":
        return S.ConcurrentASGD(seed=spec.seed, concurrency=spec.concurrency, **common)
    if name == "fedasync":
        return S.FedAsync(mixing=spec.fedasync_mixing, staleness=spec.fedasync_staleness, a=spec.fedasync_a,
                          b=spec.fedasync_b, **common)
    if name == "fedbuff":
        return S.FedBuff(buffer_size=spec.fedbuff_buffer, server_lr=spec.fedbuff_server_lr,
                         staleness_exponent=spec.staleness_exponent, **common)
    return S.STRATEGIES[name](**common)


def local_training(spec: RunSpec, strategy) -> dict[str, Any]:
    """The job config of local training when the strategy takes model replies, else {}.

    The local learning rate keeps the α convention (experiments.md) unless ``local_lr`` is set:
    FedAsync η = γ_V / (mixing · H) and FedBuff η_l = γ_V · K / (η_g · Q), with γ_V = α · τ_H /
    (n · τ_max), so that one update moves the model like one Vanilla ASGD step; the ASGD family
    η = 1 / H, so that the pseudo-gradient is the mean of the H local gradients and the server's
    own stepsize stays the method's.
    """
    if strategy.reply != "model":
        return {}
    H = spec.local_steps
    if spec.local_lr is not None:
        lr = spec.local_lr
    elif spec.strategy == "fedasync":
        lr = vanilla_stepsize(spec.taus, spec.lr) / (strategy.mixing * H)
    elif spec.strategy == "fedbuff":
        lr = vanilla_stepsize(spec.taus, spec.lr) * strategy.K / (strategy.server_lr * H)
    else:
        lr = 1.0 / H
    return {"mode": "local", "local-steps": H, "local-lr": float(lr), "prox": spec.fedasync_prox}


def make_evaluate_fn(task):
    def evaluate(step: int, arrays: ArrayRecord) -> MetricRecord:
        del step
        x = np.concatenate([a.numpy().reshape(-1) for a in arrays.values()])
        return MetricRecord(task.evaluate(x))

    return evaluate


def run(spec: RunSpec, grid: Grid | None = None, *, clock: VirtualClock | WallClock | None = None) -> dict[str, Any]:
    """Run one experiment; return its results as a flat, JSON-ready dict."""
    spec = spec.resolved()
    cfg = spec.task_config()
    task = get_task(cfg)
    strategy = make_strategy(spec)
    wall = _start(spec, cfg, task, strategy, task.initial_params(spec.seed, spec.quad_x0), grid, clock)
    _in_gradient_units(spec, strategy)
    params = strategy.x.copy()
    out = _outcome(spec, strategy, strategy.history, params, wall, task)
    if spec.out:
        odir = Path(spec.out)
        stem = f"{spec.task}_{spec.strategy}_lr{spec.lr:g}_seed{spec.seed}"
        out["csv"] = str(write_history_csv(odir / f"{stem}.csv", strategy.history))
        out["checkpoint"] = str(save_checkpoint(odir / stem, params, out)[0])
        out["png"] = str(plot_curves(odir / f"{stem}.png", {f"{spec.strategy} α={spec.lr:g}": strategy.history},
                                     logy=spec.task == "mnist"))
    return out


def run_batch(spec: RunSpec, lrs: list[float], seeds: list[int]) -> list[dict[str, Any]]:
    """Run R MNIST replicas that share one event order in a single event loop; one outcome each.

    Replica r is the run ``spec`` with α = ``lrs[r]`` and seed ``seeds[r]``: the strategy applies
    each replica's own step to its own model, and every job computes all R minibatch gradients in
    one batched call (``tasks.ReplicaTask``). The event order must not depend on the replica:
    virtual clock only, and with exponential compute times (drawn from the seed) one seed for all.
    Each outcome (model, losses, history) matches ``run`` of that replica bit for bit at the same
    torch thread count, on any CPU: the same events, minibatches and update rounding, and every
    gradient and evaluation issues the single run's matrix products. A replica whose gradient
    turns non-finite is frozen and counted under ``rejected["non-finite"]`` instead of being
    rejected for every replica.
    """
    spec = spec.resolved()
    if len(lrs) != len(seeds) or not lrs:
        raise ValueError("run_batch needs one seed per α")
    if spec.task != "mnist" or spec.clock != "virtual":
        raise ValueError("batched replicas: the mnist task on the virtual clock only")
    if spec.delays != "fixed" and len(set(seeds)) > 1:
        raise ValueError("with random compute times the replicas of one batch must share the seed")
    spec.seed = int(seeds[0])
    cfg = {**spec.task_config(), "replica-seeds": [int(s) for s in seeds]}
    task = get_task(cfg)
    strategy = make_strategy(spec)
    strategy.set_replicas([float(a) for a in lrs])
    wall = _start(spec, cfg, task, strategy, task.initial_params(), None, None)
    R, P = len(lrs), task.base.size
    n = spec.num_clients or task.num_workers
    params = strategy.x.reshape(R, P).copy()
    outs = []
    for r, (lr, seed) in enumerate(zip(lrs, seeds)):
        hist = []
        for row in strategy.history:
            h = dict(row)
            h["cumulative_stepsize"] = row["cumulative_stepsize"] * lr
            for key in ("loss", "accuracy"):
                if key in row:
                    h[key] = row[key][r]
            if "client_losses" in row:
                h["client_losses"] = row["client_losses"][r * n:(r + 1) * n]
            hist.append(h)
        rspec = RunSpec(**{**asdict(spec), "lr": float(lr), "seed": int(seed)})
        out = _outcome(rspec, strategy, hist, params[r], wall / R, task)
        out["cumulative_stepsize"] = strategy.manager.stepsize_sum * lr
        if r in strategy.frozen_replicas:
            out["rejected"] = {**out["rejected"], "non-finite": 1}
            out["frozen_at"] = strategy.frozen_replicas[r]
        out["batch"] = {"replicas": R, "index": r, "wall_seconds": wall}
        outs.append(out)
    return outs


def _start(spec: RunSpec, cfg: dict[str, Any], task, strategy, x0: np.ndarray, grid: Grid | None,
           clock: VirtualClock | WallClock | None) -> float:
    """Build the grid and clock the spec asks for (unless given), run the strategy's loop on them;
    return the wall seconds the loop took."""
    if grid is None:
        from fl_rescaled.clients.client_app import app as client_app

        from .grid import InProcessGrid

        # On the wall clock every node computes on its own thread, as real nodes would.
        grid = InProcessGrid(client_app, spec.num_clients, seed=spec.seed, threaded=spec.clock == "wall")
    train_config: dict[str, Any] = {"task": task_spec(cfg), **local_training(spec, strategy)}
    options: dict[str, Any] = {"tau_estimator": spec.tau_estimator}
    if clock is None:
        if spec.clock == "wall":
            clock = WallClock(spec.time_unit)
        else:
            clock = VirtualClock(DelayModel(spec.taus, spec.delays, spec.seed))
    if not clock.virtual and spec.emulate:
        # Clients sleep τ_i time units per job (τ_i from their node config if set there, else this).
        train_config.update({"emulate": spec.emulate, "time-unit": spec.time_unit})
        options["worker_config"] = [{"tau": float(t)} for t in spec.taus]
    wall0 = time.perf_counter()
    with _quiet_strategy_log():
        _run_strategy(spec, task, strategy, x0, grid, clock, train_config, options)
    return time.perf_counter() - wall0


@contextmanager
def _quiet_strategy_log():
    """Experiments report through their outputs: the strategies' per-evaluation INFO lines (which a
    Flower user sees, as FedAvg's) are left out unless the caller configured the strategies' logger."""
    logger = logging.getLogger("flwr.fl_rescaled")
    saved = logger.level
    if saved == logging.NOTSET:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(saved)


def _run_strategy(spec: RunSpec, task, strategy, x0: np.ndarray, grid: Grid, clock, train_config: dict[str, Any],
                  options: dict[str, Any]) -> None:
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord({"model": Array(x0)}),
        time_budget=spec.budget,
        train_config=train_config,
        timeout=spec.ttl,
        manager_options=options,
        evaluate_fn=make_evaluate_fn(task),
        clock=clock,
        eval_every=spec.eval_every or spec.budget / 200.0,
        num_workers=spec.num_clients,
        partition_query=True,  # the project's ClientApp answers it; taus and weights are per partition
        progress=spec.progress,
    )


def _in_gradient_units(spec: RunSpec, strategy) -> None:
    """Model replies: a pseudo-gradient is about η · H gradients, so the books' cumulative stepsize
    (the server's multipliers) is scaled by η · H to compare with the gradient methods'."""
    local = local_training(spec, strategy)
    if not local:
        return
    scale = local["local-lr"] * local["local-steps"]
    strategy.manager.stepsize_sum *= scale
    for row in strategy.history:
        row["cumulative_stepsize"] *= scale


def _outcome(spec: RunSpec, strategy, history: list[dict[str, Any]], params: np.ndarray, wall: float,
             task) -> dict[str, Any]:
    """The flat result dict of one run (one replica of a batch) from its history and final model."""
    final = history[-1]
    manager = strategy.manager
    out: dict[str, Any] = {
        "strategy": spec.strategy,
        "task": spec.task,
        "lr": spec.lr,
        "budget": spec.budget,
        "seed": spec.seed,
        "delays": spec.delays,
        "taus": list(spec.taus or []),
        "final_time": final["time"],
        "num_updates": manager.version,
        "gradients": sum(b.jobs_done for b in manager.books),
        "updates_per_worker": final["updates_per_worker"],
        "cumulative_stepsize": manager.stepsize_sum,
        "final_loss": final.get("loss"),
        "client_losses": final.get("client_losses"),
        "rejected": dict(manager.rejections),
        "discarded_per_worker": final["discarded_per_worker"],
        "wasted_time": final.get("wasted_time", 0.0),
        "idle_share_per_worker": final["idle_share_per_worker"],
        "lost_per_worker": final["lost_per_worker"],
        "stored_vectors_max": max(h["stored_vectors"] for h in history),
        "wall_seconds": wall,
        "tau_stats": tau_stats(spec.taus),
    }
    if "accuracy" in final:
        out["accuracy"] = final["accuracy"]
    if spec.task == "quadratic":
        out["final_params"] = params.tolist()
        out["minimizer"] = task.minimizer
        out["dist"] = final.get("dist")
    else:
        out["data_source"] = getattr(task, "source", "")
    out["history"] = history
    out["final_model"] = params
    return out


def to_json(outcome: dict[str, Any]) -> str:
    slim = {k: v for k, v in outcome.items() if k not in ("history", "final_model")}
    return json.dumps(slim, default=float)
