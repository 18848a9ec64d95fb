"""One run of an asynchronous strategy: completions in, evaluations out, failure checks."""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp import Grid

from fl_rescaled.checkpoints import write_state
from fl_rescaled.clock import Clock, DelayModel, VirtualClock, WallClock
from fl_rescaled.errors import RunFailed, client_error_text
from fl_rescaled.manager import NODE_GONE, AsyncClientManager, Completion
from fl_rescaled.metrics import ProgressBar

from .reporting import AsyncResult, FederatedEvaluation, MetricWindow, fmt_metrics

if TYPE_CHECKING:  # (the strategy imports this module; only its type is needed here)
    from .base import AsyncStrategy

log = logging.getLogger("flwr.fl_rescaled")

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


def budgets(time_budget: float | None, num_updates: int | None, eval_every: float | None,
            num_evaluations: int) -> tuple[float, int | None]:
    """Validated budgets: (time budget, inf if none; server updates, None if none)."""
    if time_budget is None and num_updates is None:
        raise ValueError("give a budget: num_updates (server updates) and/or time_budget (time units)")
    if time_budget is not None and not (time_budget > 0 and math.isfinite(time_budget)):
        raise ValueError(f"time_budget must be positive and finite, got {time_budget!r}")
    if num_updates is not None and (isinstance(num_updates, bool) or int(num_updates) != num_updates
                                    or num_updates < 1):
        raise ValueError(f"num_updates must be a positive integer, got {num_updates!r}")
    if eval_every is not None and not eval_every > 0:
        raise ValueError("eval_every must be positive")
    if num_evaluations < 1:
        raise ValueError("num_evaluations must be at least 1")
    return (float(time_budget) if time_budget is not None else math.inf,
            int(num_updates) if num_updates is not None else None)


def default_clock(grid: Grid, taus: list[float] | None, num_workers: int | None, partition_query: bool) -> Clock:
    """A virtual clock on an in-process Grid, else (Flower's runtimes) the wall clock."""
    if getattr(grid, "virtual_time", False):
        if taus is None:
            nodes = sorted(int(n) for n in grid.get_node_ids())
            if partition_query:  # the worker order is the partition order
                nodes.sort(key=lambda n: int(grid.node_config(n).get("partition-id", 0)))
            taus = [float(grid.node_config(n).get("tau", 1.0)) for n in nodes]
            if num_workers is not None:
                taus = taus[:num_workers]
            if len(set(taus)) == 1 and len(taus) > 1:
                log.warning("every node's compute time τ is %g (set 'tau' in the node configs or pass "
                            "taus): time-proportional stepsizes change nothing", taus[0])
        return VirtualClock(DelayModel(taus, "fixed"))
    if taus is not None:
        raise ValueError("taus define a virtual clock; this Grid runs on the wall clock (pass clock=...)")
    return WallClock()

@dataclass(frozen=True)
class Checkpointing:
    """Where and how often a run writes its state, and whether it starts from it.

    ``fingerprint`` identifies the run (its settings, strategy and model): a checkpoint written
    under another fingerprint is refused. ``every``: time units between checkpoints.
    """

    path: Path
    every: float
    fingerprint: str
    resume: bool = False


class EvalSchedule:
    """When to evaluate: every ``period`` time units, or every ``updates`` server updates."""

    def __init__(self, period: float, updates: int | None) -> None:
        self.period, self.updates = period, updates
        self.step, self.next_time, self.next_updates = 0, 0.0, updates or 0

    def advance(self, version: int) -> None:
        self.step += 1
        self.next_time = self.step * self.period
        if self.updates is not None:
            self.next_updates = version + self.updates


class Run:
    """One run's loop state: completions in, evaluations out, failure checks."""

    def __init__(self, strategy: AsyncStrategy, result: AsyncResult, schedule: EvalSchedule,
                 evaluate_fn: EvaluateFn | None, fed_eval: FederatedEvaluation, bar: ProgressBar, *,
                 by_time: bool) -> None:
        self.s, self.result, self.schedule, self.by_time = strategy, result, schedule, by_time
        self.evaluate_fn, self.fed_eval, self.bar = evaluate_fn, fed_eval, bar
        self.window = MetricWindow(strategy.weighted_by_key)
        #: Evaluation points whose central evaluation may still run on the Grid's pool, in order.
        self.pending: deque[tuple] = deque()
        self.submit = getattr(fed_eval.grid, "submit", None)
        manager = strategy.manager
        assert manager is not None
        self.manager = manager
        self.answered = [False] * manager.num_workers
        self.consecutive = 0
        self.limit = strategy.max_consecutive_rejections or max(20, 2 * manager.num_workers)
        self.checkpoint: Checkpointing | None = None
        self.next_checkpoint = math.inf

    # ---------------------------------------------------------------- checkpoints
    def __getstate__(self) -> dict:  # (the loop's state; what talks to the world is attached again)
        assert not self.pending, "evaluations still running: drain them before a checkpoint"
        return {**self.__dict__, "evaluate_fn": None, "fed_eval": None, "bar": None, "submit": None,
                "checkpoint": None}

    def attach(self, strategy: AsyncStrategy, evaluate_fn: EvaluateFn | None, fed_eval: FederatedEvaluation,
               bar: ProgressBar, checkpoint: Checkpointing | None) -> None:
        """After a checkpoint was read: the strategy object to go on with, and the outside world."""
        self.s, self.manager = strategy, strategy.manager
        self.evaluate_fn, self.fed_eval, self.bar = evaluate_fn, fed_eval, bar
        self.submit = getattr(fed_eval.grid, "submit", None)
        self.plan_checkpoints(checkpoint)

    def plan_checkpoints(self, checkpoint: Checkpointing | None) -> None:
        self.checkpoint = checkpoint
        if checkpoint is not None:
            now = self.manager.clock.now
            self.next_checkpoint = (math.floor(now / checkpoint.every) + 1) * checkpoint.every

    def save_checkpoint(self) -> None:
        """Write the run's state (books balanced first); the next one is due ``every`` later."""
        plan = self.checkpoint
        assert plan is not None
        self.drain(block=True)
        self.manager.ledger.check_balance()
        write_state(plan.path, self, plan.fingerprint)
        self.plan_checkpoints(plan)
        log.info("checkpoint at t=%g (%d updates): %s", self.manager.clock.now, self.manager.version, plan.path)

    def loop(self, budget: float, max_updates: int | None) -> None:
        s, manager, schedule = self.s, self.manager, self.schedule
        t = 0.0
        comp = None
        while True:
            comp = manager.next_completion(budget)
            if comp is None and manager.joined:
                for worker in manager.pop_joined():
                    s.on_worker_joined(worker)
                continue
            t = comp.time if comp is not None else (budget if math.isfinite(budget) else manager.clock.now)
            # Evaluation points strictly before this event see the model as it was; an event at
            # exactly an evaluation time is applied first (the model "at time t" includes it).
            while schedule.next_time < t - 1e-12 or (comp is None and schedule.next_time <= budget * (1 + 1e-12)):
                self.evaluate(schedule.next_time)
            if comp is None:
                if math.isinf(budget):
                    raise RunFailed("no job is in flight and no update budget is left to reach: the run "
                                    f"stopped after {manager.version} of {max_updates} updates",
                                    manager.books_summary())
                break
            self.handle(comp, t)
            if schedule.updates is not None and manager.version >= schedule.next_updates:
                self.evaluate(comp.time)
            if max_updates is not None and manager.version >= max_updates:
                break
            if manager.clock.now >= self.next_checkpoint:
                self.save_checkpoint()
        t_end = t if comp is None else comp.time  # the budget, or the time of the last update
        last = s.history[-1] if s.history else None
        if last is None or last["time"] < t_end - 1e-9 * max(1.0, abs(t_end)) or last["updates"] != manager.version:
            self.evaluate(t_end)
        self.drain(block=True)

    def handle(self, comp: Completion, t: float) -> None:
        s, manager = self.s, self.manager
        if comp.ok:
            self.consecutive = 0
            self.answered[comp.worker] = True
            if "nonfinite-replicas" in comp.metrics:
                s.freeze(comp.metrics["nonfinite-replicas"], t)
            self.window.add(comp.metrics)
            if comp.carried and s.reply == "model":
                s.carried.update(comp.carried)
            s.on_completion(comp)
        else:
            if comp.rejected not in NODE_GONE:
                self.consecutive += 1
                self.answered[comp.worker] = True
            s.on_rejected(comp)
        if s.on_event is not None:
            s.on_event(comp, s.x)
        if manager.accepted == 0 and all(self.answered):
            raise RunFailed(self.failure("no reply could be used: every worker answered and all "
                                         f"{sum(manager.rejections.values())} replies were rejected"),
                            manager.books_summary())
        if self.consecutive >= self.limit:
            raise RunFailed(self.failure(f"{self.consecutive} replies in a row were rejected"), manager.books_summary())

    def failure(self, what: str) -> str:
        first = self.manager.first_rejection
        if first is None:
            return f"the run cannot make progress: {what}"
        reason, detail = first
        text = client_error_text(detail) if reason.startswith("error-code") else detail
        return f"the run cannot make progress: {what}. The first rejection ({reason}): {text}"

    def evaluate(self, t: float) -> None:
        """One evaluation point: the books and the reply metrics now; the central evaluation on the
        Grid's pool when it has one (the loop goes on meanwhile), else here; federated evaluation."""
        s, manager, schedule, result = self.s, self.manager, self.schedule, self.result
        assert s.layout is not None
        step = schedule.step
        row: dict[str, Any] = {"time": float(t)}
        row.update(manager.summary(t))
        row["stored_vectors"] = s.stored_vectors()
        stamp = {"time": float(t), "updates": manager.version, "cumulative-stepsize": manager.stepsize_sum}
        arrays = None
        server: Any = None
        if self.evaluate_fn is not None:
            arrays = s.layout.to_record(s.x, s.carried)
            server = self.submit(self.evaluate_fn, step, arrays) if self.submit is not None else None
            if server is None:
                server = self.evaluate_fn(step, arrays)
        train = self.window.record()
        if train:
            row["train_metrics"] = train
            result.train_metrics_clientapp[step] = MetricRecord({**train, "replies": self.window.replies,
                                                                 "time": stamp["time"], "updates": stamp["updates"]})
        fed = None
        if s.fraction_evaluate > 0:
            nodes = [b.node_id for b in manager.books if b.online]
            fed = self.fed_eval.run(step, arrays or s.layout.to_record(s.x, s.carried), nodes)
        if fed is not None:
            row["evaluate_metrics"] = fed
            result.evaluate_metrics_clientapp[step] = MetricRecord({**fed, "time": stamp["time"],
                                                                    "updates": stamp["updates"]})
        s.history.append(row)
        self.pending.append((step, row, stamp, train, fed, server))
        self.window.clear()
        schedule.advance(manager.version)
        self.drain(block=False)

    def drain(self, block: bool) -> None:
        """Finish the evaluation points whose central evaluation is done, in order (all: ``block``)."""
        while self.pending:
            step, row, stamp, train, fed, server = self.pending[0]
            if isinstance(server, Future):
                if not (block or server.done()):
                    return
                server = server.result()
            self.pending.popleft()
            if server is not None:
                row.update(dict(server))
                self.result.evaluate_metrics_serverapp[step] = MetricRecord({**dict(server), **stamp})
            log.info("[t=%g | %d updates] train: %s%s%s", stamp["time"], stamp["updates"], fmt_metrics(train),
                     f" | server eval: {fmt_metrics(dict(server))}" if server is not None else "",
                     f" | federated eval: {fmt_metrics(fed)}" if fed is not None else "")
            self.bar.update(stamp["time"] if self.by_time else stamp["updates"], row)


def new_run(strategy: AsyncStrategy, grid: Grid, clock: Clock | None, taus: list[float] | None, num_workers: int | None,
            partition_query: bool | None, options: dict[str, Any], train_config: Any, timeout: float,
            observers: list | None, evaluate_fn: EvaluateFn | None, evaluate_config: Any, schedule: EvalSchedule,
            bar: ProgressBar, *, by_time: bool) -> Run:
    """The manager connected to the nodes and a fresh loop state (``start`` without a checkpoint)."""
    per_partition = taus is not None or strategy.target_weights() is not None or "worker_config" in options
    if partition_query is None:
        partition_query = per_partition
    elif per_partition and not partition_query:
        raise ValueError("per-partition settings (taus, weights, worker_config) need partition_query=True")
    if clock is None:
        clock = default_clock(grid, taus, num_workers, partition_query)
    elif taus is not None:
        raise ValueError("give either clock or taus, not both")
    if clock.virtual and num_workers is None:
        num_workers = clock.delays.num_workers
    cfg = dict(train_config.items()) if train_config is not None else {}
    strategy.manager = manager = AsyncClientManager(
        grid, clock, layout=strategy.layout, reply=strategy.reply, arrayrecord_key=strategy.arrayrecord_key,
        configrecord_key=strategy.configrecord_key, train_config=cfg, ttl=timeout, observers=observers, **options)
    manager.connect(num_workers, timeout=min(timeout, 300.0), partition_query=partition_query,
                    weights=strategy.target_weights())
    if not partition_query and manager.num_workers > 1:
        log.warning("workers are numbered by node id (%d nodes); a ClientApp with "
                    "fl_rescaled.add_partition_query numbers them by partition-id", manager.num_workers)
    if strategy.replica_lrs is not None:
        if strategy.x.size % len(strategy.replica_lrs):
            raise ValueError("the initial model is not R replicas end to end")
        manager.replicas = len(strategy.replica_lrs)
        strategy.replica_lrs = strategy._replica_alphas.copy()  # a rerun starts with no frozen replica
        strategy.frozen_replicas = {}
    fed_eval = FederatedEvaluation(grid, evaluate_config, timeout, fraction=strategy.fraction_evaluate,
                                   weighted_by_key=strategy.weighted_by_key, arrayrecord_key=strategy.arrayrecord_key,
                                   configrecord_key=strategy.configrecord_key)
    strategy.history = []
    if not clock.virtual:
        clock.restart()  # the wall-clock budget counts from the first job sent
    return Run(strategy, AsyncResult(), schedule, evaluate_fn, fed_eval, bar, by_time=by_time)
