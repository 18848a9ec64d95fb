"""The driver: one run of an asynchronous strategy, from the first job to the ``Result``.

Three roles make a run. The **algorithm** (a strategy in ``fl_rescaled.strategies``) reads one
completion at a time, updates its own state and asks for jobs. The **driver** (here) owns the run:
its state (``RunState``), the client manager, the event loop, the budgets, the evaluations, the
failure checks, checkpoints and resume, and batched replicas. The **Flower façade**
(``AsyncStrategy.start``) builds a driver and returns what it returns.

What an algorithm may do to the run is the ``Run`` protocol (``fl_rescaled.algorithm``); the
driver implements it (``tests/scripted.py`` has a scripted stand-in that unit tests feed
completions to). The loop:
ask the manager for the next completion (virtual-clock order, or arrival order), evaluate at the
evaluation points it passed, hand the completion to the algorithm, check that the run can still
make progress, write a checkpoint when one is due. A run that cannot make progress raises
``RunFailed`` with the first failure's reason instead of returning the initial model.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord

from .checkpoints import CheckpointError
from .clock import Clock, default_clock
from .divergence import Divergence
from .errors import RunFailed
from .failures import FailureCheck, diverged, freeze
from .grid_api import as_async_grid
from .layout import ModelLayout
from .algorithm import Completion
from .manager import AsyncClientManager, ManagerObserver, ManagerSettings
from .manager.books import is_lost
from .metrics import ProgressBar
from .reporting import (AsyncResult, EvaluateFn, Evaluations, FederatedEvaluation, MetricWindow, all_rejected,
                        log_end, log_start, no_update, rejected_lines, report_result)
from .runstate import Checkpointing, EvalSchedule, RunState, budgets, load, save
from .run_api import Algorithm, RunAPI

log = logging.getLogger("flwr.fl_rescaled")


class Driver(RunAPI):
    """One run: see the module docstring. ``run()`` returns the ``AsyncResult``."""

    def __init__(self, strategy: Algorithm, grid: Any, initial_arrays: ArrayRecord, *, num_updates: int | None = None,
                 time_budget: float | None = None, timeout: float = 3600.0, train_config: Any = None,
                 evaluate_config: Any = None, evaluate_fn: EvaluateFn | None = None, clock: Clock | None = None,
                 taus: list[float] | None = None, eval_every: float | None = None, num_evaluations: int | None = None,
                 num_workers: int | None = None, partition_query: bool | None = None, progress: bool = False,
                 observers: list[ManagerObserver] | None = None, checkpoint: Checkpointing | None = None,
                 settings: ManagerSettings | None = None, replicas: Sequence[float] | None = None,
                 seed: int = 0, divergence: Divergence | None = Divergence(), num_trainings: int | None = None,
                 finish_in_flight: bool = False, num_rounds: int | None = None) -> None:
        self.strategy = strategy
        self.finish_in_flight = bool(finish_in_flight)
        self.seed = int(seed)
        self.budget, self.max_updates, self.max_trainings = budgets(time_budget, num_updates, eval_every,
                                                                    num_evaluations, num_trainings, num_rounds)
        #: FedAvg's rounds (``max_trainings`` = rounds × C) and the cadence, decided at the start (``_per_round``).
        self.rounds, self.cadence = num_rounds, (eval_every, num_evaluations)
        self.by_time = time_budget is not None
        #: What the progress bar counts: the budget the run has (time first, then updates, trainings).
        self.bar_key = "time" if self.by_time else "updates" if self.max_updates is not None else "trainings"
        #: Client trainings so far: replies delivered (accepted or rejected; ``Books.trainings``).
        self.trainings = 0
        self.layout, x, carried = ModelLayout.of(initial_arrays)
        settings = settings or ManagerSettings()
        self.grid = as_async_grid(grid, settings.poll_interval)
        lrs = None if replicas is None else np.asarray(replicas, np.float64)
        if lrs is not None and (not lrs.size or x.size % lrs.size or not (lrs > 0).all() or not np.isfinite(lrs).all()):
            raise ValueError("replicas: one positive α per replica, and the model the replicas end to end")
        schedule = EvalSchedule.first(eval_every, num_evaluations, self.budget, self.max_updates, self.max_trainings)
        evaluation, keys = strategy.evaluation, strategy.run_options
        window = MetricWindow(evaluation.weighted_by_key, kept=None if evaluation.train_metrics_aggr_fn is None else [])
        self.state = RunState(x=x, carried=carried, schedule=schedule, window=window, replica_lrs=lrs)
        self._scratch = np.empty(0, x.dtype)  # (sized at the first step)
        self.configures_jobs = strategy.configures_jobs
        self.plan = None if checkpoint is None else checkpoint.covering(strategy, self.layout, self.budget,
                                                                         self.max_updates, self.max_trainings,
                                                                         num_rounds)
        per_partition = taus is not None or strategy.target_weights() is not None or settings.worker_config is not None
        if partition_query is None:
            partition_query = per_partition
        elif per_partition and not partition_query:
            raise ValueError("per-partition settings (taus, weights, worker_config) need partition_query=True")
        if clock is None:
            clock = default_clock(self.grid, taus, num_workers, partition_query, strategy.uses_tau)
        elif taus is not None:
            raise ValueError("give either clock or taus, not both")
        if num_workers is None:
            num_workers = clock.num_workers  # (the virtual clock's compute-time model knows them)
        self.connect_args = (num_workers, min(timeout, 300.0), partition_query)
        cfg = dict(train_config.items()) if train_config is not None else {}
        self.manager = AsyncClientManager(
            self.grid, clock, layout=self.layout, reply=strategy.reply, arrayrecord_key=keys.arrayrecord_key,
            configrecord_key=keys.configrecord_key, train_config=cfg, ttl=timeout, observers=observers,
            replicas=1 if lrs is None else lrs.size, settings=settings, bound=strategy.bounds.chain())
        self.manager.influence = lambda worker: strategy.influence(self, worker)
        fed = FederatedEvaluation(self.grid, evaluate_config, timeout, fraction=evaluation.fraction_evaluate,
                                  min_nodes=evaluation.min_evaluate_nodes, weighted_by_key=evaluation.weighted_by_key,
                                  arrayrecord_key=keys.arrayrecord_key, configrecord_key=keys.configrecord_key,
                                  aggregate=evaluation.evaluate_metrics_aggr_fn)
        bar = ProgressBar({"time": self.budget, "updates": self.max_updates, "trainings": self.max_trainings}[self.bar_key]
                          or 1, enabled=progress, label=strategy.name)  # (num_rounds: set at the start)
        self.divergence = divergence if lrs is None else None  # (a batch's losses are the replicas')
        self.evaluations = Evaluations(self.grid, evaluate_fn, fed, bar, train_aggregate=evaluation.train_metrics_aggr_fn,
                                       on_evaluation=strategy.on_evaluation, unit=clock.unit_label,
                                       on_point=None if self.divergence is None else self._watch)
        self.check, self.next_checkpoint, self.wall_seconds = FailureCheck(1), math.inf, 0.0

    # ---------------------------------------------------------------- the run
    def run(self) -> AsyncResult:
        """Start (or resume), loop until a budget is spent, and return Flower's ``Result`` (the log
        says what runs, as Flower's strategies' do, and how it ended). The driver keeps the run
        (its manager, books and state) readable after it."""
        strategy, manager, state = self.strategy, self.manager, self.state
        log_start(type(strategy).__name__, self.layout, self.budget if self.by_time else None, self.max_updates,
                  self.max_trainings, self.rounds)
        strategy.summary()
        log.info("")
        if self.plan is None or not self.plan.resume:
            manager.source.start()  # (the wall clock counts from here, as FedAvg's execution time does)
        wall0 = time.perf_counter()
        if self.plan is not None and self.plan.resume:
            self._resume()
        else:
            num_workers, timeout, partition_query = self.connect_args
            manager.connect(num_workers, timeout=timeout, partition_query=partition_query,
                            weights=strategy.target_weights(), min_nodes=strategy.population.min_available_nodes)
            manager.populate(strategy.population.slots(manager.num_workers), self.seed, strategy.target_weights(),
                             strategy.population.selection)
            self._per_round(manager.num_workers)
            if not partition_query and manager.num_workers > 1:  # (what to do only if partitions matter: DEBUG)
                log.debug("workers are numbered by node id (%d nodes); a ClientApp with "
                          "fl_rescaled.add_partition_query numbers them by partition-id", manager.num_workers)
            state.answered = np.zeros(manager.num_workers, bool)
            state.algorithm = strategy.init_state(self)
            self._admission()
            self._plan_checkpoints()
            strategy.on_start(self)
        self.check = FailureCheck(strategy.run_options.max_consecutive_rejections or max(20, 2 * manager.num_workers))
        state = self.state  # (resumed: the state read from the checkpoint)
        self._loop()
        self.evaluations.bar.close()
        self.wall_seconds = time.perf_counter() - wall0
        in_flight = int(manager.books.in_flight.sum())
        if in_flight:
            log.info("%d job%s still in flight at the end %s not applied (counted in Result.books['in-flight'])",
                     in_flight, "s" if in_flight != 1 else "", "were" if in_flight != 1 else "was")
        for line in rejected_lines(all_rejected(manager.books), manager.membership.name):
            log.warning("%s", line)
        if manager.version == 0:  # (the initial model back is no result: say why)
            raise RunFailed(self.check.failure(manager.books, no_update(manager.books)), manager.books_totals())
        result = self._result(state.x, state.carried)
        try:
            manager.books.check_balance()  # every job sent is accounted for, per worker
        except AssertionError as exc:
            raise RunFailed(str(exc), manager.books_totals()) from None
        report_result(result)
        log_end(result, self.wall_seconds)
        return result

    def _per_round(self, n: int) -> None:
        """What the run's ``n`` workers decide at its start: FedAvg's clients per round C (``population.slots``),
        hence a ``num_rounds`` budget's trainings (rounds × C) and the default evaluations, a point every C
        trainings, so that a run evaluates as often as FedAvg would for the same trainings."""
        c = self.strategy.population.slots(n)
        if self.rounds is not None:
            self.max_trainings = self.rounds * c
            if self.bar_key == "trainings":
                self.evaluations.bar.set_total(self.max_trainings)
        self.state.schedule = EvalSchedule.first(*self.cadence, self.budget, self.max_updates, self.max_trainings, c)

    def _result(self, x: np.ndarray, carried: dict[str, np.ndarray]) -> AsyncResult:
        """Flower's ``Result`` with the model ``x`` (and ``carried``) and the metrics and books so far."""
        state, result = self.state, AsyncResult()
        result.arrays = self.layout.to_record(x, carried)
        for target, metrics in ((result.train_metrics_clientapp, state.train_metrics),
                                (result.evaluate_metrics_clientapp, state.client_metrics),
                                (result.evaluate_metrics_serverapp, state.server_metrics),
                                (result.progress, state.progress)):
            target.update({step: MetricRecord(values) for step, values in metrics.items()})
        result.books = MetricRecord(self.manager.books_totals())
        result.privacy = self.strategy.report(state.algorithm)
        return result

    def _watch(self, step: int, server: Any, federated: Any, arrays: ArrayRecord | None) -> None:
        """An evaluation point is finished: raise ``RunFailed`` (with the best model so far) if the
        model diverged (``fl_rescaled.divergence``)."""
        assert self.divergence is not None
        watched = self.state.divergence

        def model() -> tuple[np.ndarray, dict[str, np.ndarray]]:
            flat, carried = self.layout.flatten(arrays, check_finite=False)
            return np.array(flat), {k: np.array(v) for k, v in carried.items()}

        why = None if arrays is None else self.divergence.point(watched, step, server, federated, model)
        if why is None:
            return
        best = watched.best_step >= 0
        result = self._result(watched.best_x, watched.best_carried) if best else None
        raise RunFailed(diverged(why, self.manager, watched.best_step, watched.best_loss),
                        self.manager.books_totals(), result)

    def update(self) -> Completion | None:
        """One update, in the order it happens: the plan of every update of every strategy.

        1. match: the next job to end, in the clock's order, with the reply that answers it
           (``AsyncClientManager.next_ended``: the completion source, the transport);
        2. validate: the reply's arrays and metrics against the model (``validate``: ``layout``);
        3. bound: the update through the strategy's bounds (``apply_bounds``: ``bounds``, ``peer_bounds``);
        4. book: its outcome and compute time, its worker's reputation (``book``: ``books``,
           ``reputation``); then the evaluation points before it, which see the model as it was;
        5. step: the algorithm takes γ from its rule and applies x ← x − γ g (``on_completion``,
           ``apply``), or, for a rejected reply, leaves the model as it is (``on_rejected``);
        6. next job: the algorithm asks for the next job (``send_next``: the selection, the transport).

        Returns the completion, or None when no job ends before the budget, or workers came back
        (the caller gives them jobs).
        """
        manager = self.manager
        ended = manager.next_ended(math.inf if self.closed else self.budget)  # 1. match
        if ended is None:
            return None
        comp, reply = ended
        if reply is not None:
            manager.validate(comp, reply)  # 2. validate
            manager.apply_bounds(comp)  # 3. bound
        manager.book(comp)  # 4. book
        if not self.closed:  # (waiting for the last jobs: the evaluation points are all behind)
            self._evaluate_before(comp.time, ended=False)
        if reply is not None and (comp.ok or not is_lost(comp.rejected)):
            self.trainings += 1  # (a training delivered: accepted or rejected; ``Books.trainings``)
        self.handle(comp)  # 5. step and 6. next job (the algorithm's)
        return comp

    def _evaluate_before(self, t: float, ended: bool) -> None:
        """Evaluation points strictly before an event at ``t`` see the model as it was; an event at
        exactly an evaluation time is applied first (the model "at time t" includes it). When the
        run has ``ended``, every point up to the budget."""
        schedule, budget = self.state.schedule, self.budget
        while schedule.next_time < min(t, budget) - 1e-12 or (ended and schedule.next_time <= budget * (1 + 1e-12)):
            self.evaluate(schedule.next_time)

    def _loop(self) -> None:
        manager, budget = self.manager, self.budget
        schedule = self.state.schedule  # (after a resume: the checkpoint's)
        why = None
        while True:
            comp = self.update()
            if comp is None and manager.waiting:  # workers came back, or slots waited for them
                joined = manager.pop_joined()
                if manager.population.sampled:
                    self.refill()
                else:
                    for worker in joined:
                        self.strategy.on_joined(self, worker)
                continue
            if comp is None:
                t_end = budget if math.isfinite(budget) else manager.clock.now
                self._evaluate_before(t_end, ended=True)
                if math.isinf(budget):
                    raise RunFailed("no job is in flight and no update budget is left to reach: the run "
                                    f"stopped after {manager.version} updates and {self.trainings} trainings "
                                    f"(budget: {self.max_updates or self.max_trainings} "
                                    f"{'updates' if self.max_updates else 'trainings'})", manager.books_totals())
                break
            t_end = comp.time  # (the time of the last update)
            if (schedule.updates is not None and manager.version >= schedule.next_updates) or \
                    (schedule.trainings is not None and self.trainings >= schedule.next_trainings):
                self.evaluate(comp.time)
            if (self.max_updates is not None and manager.version >= self.max_updates) or \
                    (self.max_trainings is not None and self.trainings >= self.max_trainings):
                break
            why = self.strategy.stopped(self.state.algorithm)
            if why is not None:  # (a private run whose clients' budgets are spent: nothing more may be applied)
                log.warning("%s", why)
                break
            if manager.clock.now >= self.next_checkpoint:
                self.save_checkpoint()
        if self.finish_in_flight and why is None:
            t_end = self._finish(t_end)
        history = self.state.history
        last = history[-1] if history else None
        if last is None or last["time"] < t_end - 1e-9 * max(1.0, abs(t_end)) or last["updates"] != manager.version:
            self.evaluate(t_end)
        self.evaluations.drain(self.state, block=True)

    def _finish(self, t_end: float) -> float:
        """The budget is spent: wait for the jobs still in flight (``finish_in_flight``), sending none;
        each reply goes to the algorithm as any other, a job silent past its TTL is lost. Returns the
        time of the last completion."""
        manager = self.manager
        waiting = int(manager.books.in_flight.sum())
        if not waiting:
            return t_end
        log.info("waiting for the %d job%s still in flight (finish_in_flight)", waiting, "s" * (waiting != 1))
        self.closed = True
        while manager.books.in_flight.any():
            comp = self.update()
            if comp is not None:
                t_end = comp.time
            elif manager.waiting:
                manager.pop_joined()  # (nodes that came back: the run sends no more jobs)
            else:  # (nothing can end any more: what is left stays counted in flight, never a hang)
                break
        return t_end

    def handle(self, comp: Completion) -> None:
        """One completion: the window of reply metrics, the algorithm, the failure checks."""
        strategy, state = self.strategy, self.state
        if comp.ok:
            if "nonfinite-replicas" in comp.metrics:
                freeze(state, comp.metrics["nonfinite-replicas"], comp.time)
            state.window.add(comp.metrics)
            if comp.carried and strategy.reply == "model":
                state.carried.update(comp.carried)
            strategy.on_completion(self, comp)
        else:
            strategy.on_rejected(self, comp)
        for obs in self.manager.observers:
            obs.handled(comp, state.x)
        self.check(state, self.manager, comp)

    def evaluate(self, t: float) -> None:
        manager, state = self.manager, self.state
        ids = manager.membership.roster.node_ids
        reported = self.strategy.report(state.algorithm)
        extra = {f"dp_{k}": reported[k] for k in ("max_epsilon", "mean_epsilon") if k in reported}
        if extra:
            log.info("privacy at t=%g (%d updates): ε max %.4g, mean %.4g (δ = %.3g)", t, manager.version,
                     extra["dp_max_epsilon"], extra["dp_mean_epsilon"], reported["delta"])
        self.evaluations.point(state, t, {**manager.summary(t), "trainings": self.trainings},
                               lambda: self.layout.to_record(state.x, state.carried),
                               lambda: [ids[w] for w in manager.online_workers()], self.strategy.stored_vectors(self.state.algorithm),
                               self.bar_key, extra)
        if "epsilon" in reported and len(reported["epsilon"]) <= 1000:  # (the figure of ε per client over time)
            state.history[-1]["dp_epsilon_per_worker"] = list(reported["epsilon"])

    # ---------------------------------------------------------------- checkpoints
    def _plan_checkpoints(self) -> None:
        if self.plan is not None:
            every, now = self.plan.every, self.manager.clock.now
            self.next_checkpoint = (math.floor(now / every) + 1) * every

    def save_checkpoint(self) -> None:
        """Write the run's state (books balanced first); the next one is due ``every`` later."""
        assert self.plan is not None
        self.evaluations.drain(self.state, block=True)
        self.manager.books.check_balance()
        self.state.manager = self.manager.state()
        save(self.plan, self.state)
        self.state.manager = None
        self._plan_checkpoints()
        log.info("checkpoint at t=%g (%d updates): %s", self.manager.clock.now, self.manager.version, self.plan.path)

    def _admission(self) -> None:
        """A strategy that limits who may be selected (a private run's budgets) decides for the selection."""
        admits = self.strategy.admits
        if admits is not None:
            self.manager.population.admit_only(lambda w: admits(self.state.algorithm, w))

    def _resume(self) -> None:
        """Go on from the plan's checkpoint. Every part checks what it restores against its own
        invariants (the run's schedule and history here, the manager's parts in
        ``AsyncClientManager.resume``, the strategy's state in ``check_state``): a value no run
        could have written is refused (``CheckpointError``, one line) before anything runs. The
        clock's source says what happens to the jobs that were in flight."""
        assert self.plan is not None
        strategy, manager = self.strategy, self.manager
        loaded = load(self.plan, strategy.State)
        saved = loaded.manager
        assert saved is not None
        self._per_round(saved.books.n)
        self.trainings = saved.books.trainings
        try:
            loaded.check_restored(self.state, saved.books.n)
            needs_jobs = manager.resume(saved, strategy.population.slots(saved.books.n), self.seed,
                                        strategy.target_weights(), strategy.population.selection)
            loaded.check_history(manager.clock.now, manager.version, self.trainings)
            strategy.check_state(loaded.algorithm, manager.num_workers, loaded.x)
        except ValueError as exc:
            raise CheckpointError(f"{self.plan.path}: {exc}") from None
        lost = len(saved.jobs) - len(manager.transport.inflight)
        loaded.manager = None
        self.state = loaded
        self._admission()
        self._plan_checkpoints()
        for worker in needs_jobs:
            strategy.on_joined(self, worker)
        (log.warning if lost else log.info)(
            "resumed from %s at t=%g (%d updates): %d jobs in flight counted as lost, %d of %d workers online",
            self.plan.path, manager.clock.now, manager.version, lost, len(manager.online_workers()),
            manager.num_workers)
