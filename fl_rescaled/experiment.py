"""One simulated run, described by a ``RunSpec``: shared by ``run_sim.py``, the ServerApp and the study.

``run(spec)`` builds the task, the strategy (from the registry, with ``spec.options``), the clock
and (by default) the in-process Grid with the project's ClientApp, runs the strategy's asynchronous
loop, writes the CSV/PNG outputs and returns a flat dict of results (the JSON printed by
``run_sim.py --json``). ``run_batch`` runs several α and seeds that share an event order in one loop.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.serverapp import Grid

from .divergence import Divergence
from .checkpoints import save_model
from .clients.client_app import app as client_app
from .availability import availability
from .clock import Clock, VirtualClock, WallClock, tau_stats
from .delays import compute_times
from .driver import Driver
from .grid import InProcessGrid
from .tasks.batched import resolve_device
from .layout import decode_array
from .manager import ManagerObserver
from .manager.books import PER_WORKER_ROWS
from .metrics import plot_curves, write_history_csv
from .privacy import plot_epsilons
from .reporting import all_rejected
from .runspec import RunSpec, bounded, default_taus, reachable
from .runstate import Checkpointing
from .stepsizes import vanilla_stepsize
from .strategies import AsyncDPAdaptiveClipping, AsyncDPFixedClipping, AsyncStrategy, options
from .tasks import get_task, task_spec
from .timeline import Timeline, write_run_figures

__all__ = ["RunSpec", "default_taus", "local_training", "make_strategy", "run", "run_batch", "to_json"]

#: Where this runner's defaults differ from a strategy's: the project's ClientApp has no
#: ``@app.evaluate`` (runs are scored centrally), so no federated evaluation.
RUNNER_DEFAULTS = {"fraction_evaluate": 0.0}


def make_strategy(spec: RunSpec) -> AsyncStrategy:
    """The strategy a spec names, with α, ``spec.options`` and the runner's defaults."""
    values = {**RUNNER_DEFAULTS, **spec.options}
    if spec.lr is not None:
        values["lr"] = spec.lr
    strategy = options.build(spec.strategy, values)
    dp = (spec.dp_noise_multiplier, spec.dp_clipping_norm)
    if dp == (None, None):
        if spec.dp_delta is not None or spec.dp_target_epsilon is not None or spec.dp_target_quantile is not None:
            raise ValueError("--dp-delta, --dp-target-epsilon and --dp-target-quantile need --dp-noise-multiplier "
                             "and --dp-clipping-norm")
        return strategy
    if None in dp:
        raise ValueError("differential privacy needs both --dp-noise-multiplier and --dp-clipping-norm")
    if spec.dp_target_quantile is not None:
        return AsyncDPAdaptiveClipping(strategy, noise_multiplier=dp[0], initial_clipping_norm=dp[1],
                                       target_clipped_quantile=spec.dp_target_quantile, delta=spec.dp_delta,
                                       target_epsilon=spec.dp_target_epsilon, seed=spec.seed)
    return AsyncDPFixedClipping(strategy, noise_multiplier=dp[0], clipping_norm=dp[1], delta=spec.dp_delta,
                                target_epsilon=spec.dp_target_epsilon, seed=spec.seed)


def resolve(spec: RunSpec) -> RunSpec:
    """``spec.resolved()``, with the strategy's own checks of its options (a bad one fails here)."""
    s = spec.resolved()
    if s.clock == "virtual":  # trace files and speed changes are read and checked now, not mid-run
        try:
            delays = virtual_clock(s).delays
        except (OSError, ValueError) as exc:  # (a trace file: name the flag that gave it)
            flags = [f"--{k}" for k, on in (("delay-trace", s.delays == "trace"), ("speed-drift", s.speed_drift),
                                            ("availability-trace", s.availability == "trace")) if on]
            why = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) else str(exc)
            raise ValueError(f"{' / '.join(flags) or '--delays'}: {why}") from None
    strategy = make_strategy(s)
    # (a trace's clients: their τ are its means)
    bounded(dataclasses.replace(s, taus=delays.means().tolist()) if s.delays == "trace" and s.clock == "virtual"
            else s, strategy)
    reachable(s, strategy)
    if s.lr is None and not strategy.lr_per_run:  # (else α is the run's: see the outcome's "lr")
        s.lr = strategy.lr
    concurrency = strategy.population.concurrency
    if concurrency is not None and concurrency > s.num_clients:
        raise ValueError(f"--concurrency must be in 1..{s.num_clients}")
    if strategy.population.min_available_nodes > s.num_clients:  # (it would wait for nodes that never come)
        raise ValueError(f"--min-available-nodes must be in 1..{s.num_clients} (the run's clients)")
    return s


def local_training(spec: RunSpec, strategy: AsyncStrategy) -> dict[str, Any]:
    """The job config of local training when the strategy takes model replies, else {}.

    The local learning rate keeps the α convention (experiments.md) unless ``local_lr`` is set: the
    strategy's ``local_lr`` hook gives it from Vanilla ASGD's step γ_V = α · τ_H / (n · τ_max).
    """
    if strategy.reply != "model":
        return {}
    H = spec.local_steps
    lr = spec.local_lr if spec.local_lr is not None else strategy.local_lr(vanilla_stepsize(spec.taus, strategy.lr), H,
                                                                                     spec.num_clients)
    return {"mode": "local", "local-steps": H, "local-lr": float(lr), "prox": spec.prox}


def make_evaluate_fn(task):
    def evaluate(step: int, arrays: ArrayRecord) -> MetricRecord:
        # decode_array, not Array.numpy(): np.load parses the header with ast.literal_eval, and on
        # CPython 3.11 two threads building ASTs at once can raise SystemError (python/cpython#106905);
        # evaluations run on the Grid's pool, two at a time with --workers 2.
        del step
        x = np.concatenate([decode_array(a).reshape(-1) for a in arrays.values()])
        return MetricRecord(task.evaluate(x))

    return evaluate


def run(spec: RunSpec, grid: Grid | None = None, *, clock: Clock | None = None,
        observers: list[ManagerObserver] | None = None, divergence: Divergence | None = Divergence()) -> dict[str, Any]:
    """Run one experiment; return its results as a flat, JSON-ready dict. ``divergence``: when the
    run fails as diverged (``AsyncStrategy.start``); None for a sweep that records it instead."""
    spec = resolve(spec)
    spec.prepare_out()
    cfg = spec.task_config()
    task = get_task(cfg)
    if hasattr(task, "prepare"):  # the data, before the run starts: DataUnavailable here, not in a job
        task.prepare()
    strategy = make_strategy(spec)
    timeline = Timeline.sampled(spec.num_clients, seed=spec.seed)
    driver, wall = _start(spec, cfg, task, strategy, task.initial_params(spec.seed, spec.quad_x0), grid, clock,
                          [*(observers or []), timeline], divergence=divergence)
    _in_gradient_units(spec, driver)
    params = driver.state.x.copy()
    out = _outcome(spec, driver, driver.state.history, params, wall, task)
    out["staleness"] = timeline.staleness()
    if spec.out:
        odir = Path(spec.out)
        stem = spec.output_stem(out["lr"])
        out["csv"] = str(write_history_csv(odir / f"{stem}.csv", driver.state.history))
        settings = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("progress", "extra")}
        out["checkpoint"] = str(save_model(odir / stem, params, {**out, "settings": settings})[0])
        out["png"] = str(plot_curves(odir / f"{stem}.png", {f"{spec.strategy} α={out['lr']:g}": driver.state.history},
                                     logy=spec.task == "mnist"))
        if "dp" in out and any("dp_epsilon_per_worker" in h for h in driver.state.history):
            out["dp_png"] = str(plot_epsilons(odir / f"{stem}_epsilon.png", driver.state.history,
                                              target=spec.dp_target_epsilon, title=stem))
        t_end, books = out["final_time"], driver.manager.books
        out.update(write_run_figures(odir, stem, timeline, books, t_end=t_end, title=stem,
                                     busy=driver.manager.source.busy(books.busy_done, t_end),
                                     availability=driver.manager.clock.availability))
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
    spec = resolve(spec)
    if len(lrs) != len(seeds) or not lrs:
        raise ValueError("run_batch needs one seed per α")
    if spec.task != "mnist" or spec.clock != "virtual":
        raise ValueError("batched replicas: the mnist task on the virtual clock only")
    if spec.delays != "fixed" and len(set(seeds)) > 1:
        raise ValueError("with random compute times the replicas of one batch must share the seed")
    spec.seed = int(seeds[0])
    cfg = {**spec.task_config(), "replica-seeds": [int(s) for s in seeds]}
    task = get_task(cfg)
    task.prepare()  # the data, before the run starts (DataUnavailable)
    strategy = make_strategy(dataclasses.replace(spec, lr=1.0))  # (every rule is linear in α)
    driver, wall = _start(spec, cfg, task, strategy, task.initial_params(), replicas=[float(a) for a in lrs])
    R, P = len(lrs), task.base.size
    n = spec.num_clients or task.num_workers
    params = driver.state.x.reshape(R, P).copy()
    outs = []
    for r, (lr, seed) in enumerate(zip(lrs, seeds)):
        hist = []
        for row in driver.state.history:
            h = dict(row)
            h["cumulative_stepsize"] = row["cumulative_stepsize"] * lr
            for key in ("loss", "accuracy"):
                if key in row:
                    h[key] = row[key][r]
            if "client_losses" in row:
                h["client_losses"] = row["client_losses"][r * n:(r + 1) * n]
            hist.append(h)
        rspec = dataclasses.replace(spec, lr=float(lr), seed=int(seed))
        out = _outcome(rspec, driver, hist, params[r], wall / R, task)
        out["lr"] = float(lr)  # (the batch's strategy steps with α = 1; each replica scales it)
        out["cumulative_stepsize"] = driver.manager.books.stepsize_sum * lr
        if r in driver.state.frozen:
            out["rejected"] = {**out["rejected"], "non-finite": 1}
            out["frozen_at"] = driver.state.frozen[r]
        out["batch"] = {"replicas": R, "index": r, "wall_seconds": wall}
        outs.append(out)
    return outs


def _start(spec: RunSpec, cfg: dict[str, Any], task, strategy: AsyncStrategy, x0: np.ndarray,
           grid: Grid | None = None, clock: Clock | None = None,
           observers: list[ManagerObserver] | None = None, replicas: list[float] | None = None,
           divergence: Divergence | None = Divergence()) -> tuple[Driver, float]:
    """Build the grid and clock the spec asks for (unless given), run the strategy's loop on them;
    return the finished run's driver and the wall seconds the loop took."""
    if spec.task == "mnist":
        _set_torch_threads(spec.torch_threads)
    in_process = grid is None
    if grid is None:
        # On the wall clock every node computes on its own thread, as real nodes would.
        # Its node ids ascend with the partitions (the project's ClientApp answers the partition
        # query, but asking every node of a large population would cost more than the run).
        grid = InProcessGrid(client_app, spec.num_clients, seed=spec.seed, threaded=spec.clock == "wall",
                             workers=spec.workers if spec.clock == "virtual" else 1, ahead=spec.ahead,
                             ordered_ids=True, batch=not spec.no_batch)
    train_config: dict[str, Any] = {"task": task_spec(cfg), **local_training(spec, strategy)}
    if spec.device != "cpu" and spec.task == "mnist":  # (in process: resolved here, a missing GPU fails now)
        train_config["device"] = resolve_device(spec.device) if in_process else spec.device
    settings = spec.manager
    if clock is None:
        clock = WallClock(spec.time_unit) if spec.clock == "wall" else virtual_clock(spec)
    if not clock.virtual and spec.emulate:
        # Clients sleep τ_i time units per job (τ_i from their node config if set there, else this).
        train_config.update({"emulate": spec.emulate, "time-unit": spec.time_unit})
        settings = dataclasses.replace(settings, worker_config=[{"tau": float(t)} for t in spec.taus])
    wall0 = time.perf_counter()
    with _quiet_strategy_log():
        driver = Driver(
            strategy,
            grid,
            ArrayRecord({"model": Array(x0)}),
            time_budget=spec.budget,
            num_trainings=spec.num_trainings,
            train_config=train_config,
            timeout=spec.ttl,
            settings=settings,
            replicas=replicas,
            seed=spec.seed,
            evaluate_fn=make_evaluate_fn(task),
            clock=clock,
            eval_every=spec.eval_every or spec.budget / 200.0,
            num_workers=spec.num_clients,
            partition_query=True,  # the project's ClientApp answers it; taus and weights are per partition
            progress=spec.progress,
            observers=observers,
            checkpoint=_checkpointing(spec),
            divergence=divergence,
        )
        try:
            driver.run()
        finally:
            if in_process:
                grid.close()
    return driver, time.perf_counter() - wall0


def virtual_clock(spec: RunSpec) -> VirtualClock:
    """The virtual clock a spec describes: its compute-time model (with speeds that change) and when
    each client is online."""
    drift = None if spec.speed_drift is None else {"rate": spec.speed_drift}
    switch = None
    if spec.speed_switch is not None:
        at, factor, *rest = spec.speed_switch
        switch = {"at": at, "factor": factor, **({"fraction": rest[0]} if rest else {})}
    trace = spec.delay_trace if spec.delays == "trace" else None
    delays = compute_times(spec.delays, None if trace else spec.taus, seed=spec.seed, sigma=spec.delay_sigma,
                           alpha=spec.delay_alpha, trace=trace, drift=drift, switch=switch)
    avail = None
    if spec.availability != "always":
        avail = availability(spec.availability, spec.num_clients, seed=spec.seed, period=spec.availability_period,
                             fraction=spec.availability_fraction,
                             trace=spec.availability_trace if spec.availability == "trace" else None)
    return VirtualClock(delays, avail)


def _checkpointing(spec: RunSpec) -> Checkpointing | None:
    path = spec.checkpoint_path()
    if path is None:
        return None
    every = spec.checkpoint_every if spec.checkpoint_every is not None else math.inf
    # (one of several strategies: a checkpoint the killed command never wrote starts that run afresh)
    resume = spec.resume is not None and (spec.checkpoint_name is None or path.exists())
    return Checkpointing(path, every, spec.fingerprint(), resume=resume)


def _set_torch_threads(threads: int) -> None:
    """One setting for every job and evaluation of a run (the in-process pool mirrors it)."""
    import torch  # heavy: only MNIST runs need it

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@contextmanager
def _quiet_strategy_log() -> Iterator[None]:
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


def _in_gradient_units(spec: RunSpec, driver: Driver) -> None:
    """Model replies: a pseudo-gradient is about η · H gradients, so the books' cumulative stepsize
    (the server's multipliers) is scaled by η · H to compare with the gradient methods'."""
    local = local_training(spec, driver.strategy)
    if not local:
        return
    scale = local["local-lr"] * local["local-steps"]
    driver.manager.books.stepsize_sum *= scale
    for row in driver.state.history:
        row["cumulative_stepsize"] *= scale


def _outcome(spec: RunSpec, driver, history: list[dict[str, Any]], params: np.ndarray, wall: float,
             task) -> dict[str, Any]:
    """The flat result dict of one run (one replica of a batch) from its history and final model."""
    final = history[-1]
    manager = driver.manager
    books = manager.books
    out: dict[str, Any] = {
        "strategy": spec.strategy,
        "task": spec.task,
        "lr": float(getattr(driver.state.algorithm, "alpha", driver.strategy.lr)),
        "budget": spec.budget,
        "seed": spec.seed,
        "delays": spec.delays,
        "num_clients": spec.num_clients,
        "taus": list(spec.taus or []) if len(spec.taus or []) <= PER_WORKER_ROWS else "(see tau_stats)",
        "final_time": final["time"],
        "num_updates": books.version,
        "trainings": books.trainings,
        "gradients": int(sum(c.sum() for k, c in books.outcomes.items() if k != "cancelled")),
        "updates_per_worker": final.get("updates_per_worker"),
        "cumulative_stepsize": books.stepsize_sum,
        "final_loss": final.get("loss"),
        "client_losses": final.get("client_losses"),
        "worst_client_loss": final.get("worst_client_loss"),
        "rejected": books.failures(),
        "all_rejected": [{"client": w, "rejected": k, "reasons": r} for w, k, r in all_rejected(books)[:PER_WORKER_ROWS]],
        "stray": dict(books.stray),
        "discarded_per_worker": final.get("discarded_per_worker"),
        "wasted_time": final.get("wasted_time", 0.0),
        "idle_share_per_worker": final.get("idle_share_per_worker"),
        "idle_share_mean": final["idle_share_mean"],
        "lost_per_worker": final.get("lost_per_worker"),
        "stored_vectors_max": max(h["stored_vectors"] for h in history),
        "books": manager.books_totals(),
        "wall_seconds": wall,
        "loop_seconds": driver.wall_seconds,
        "tau_stats": tau_stats(spec.taus),
    }
    if "accuracy" in final:
        out["accuracy"] = final["accuracy"]
    reported = driver.strategy.report(driver.state.algorithm)
    if reported:  # (a private run: ε per client; an infinite one, without noise, as null)
        out["dp"] = {k: ([None if e == math.inf else e for e in v] if k == "epsilon" else
                         None if v == math.inf else v) for k, v in reported.items()}
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
