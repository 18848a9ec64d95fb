"""The event loop shared by every asynchronous strategy.

``AsyncStrategy.start`` replaces Flower's round loop. It hands the strategy one finished job at a
time (``on_completion``), in virtual-clock order in simulation and in arrival order on the wall
clock; evaluates the global model about ten times by default (centrally with ``evaluate_fn``, and
on the nodes' ``@app.evaluate`` with ``fraction_evaluate``); aggregates every numeric metric the
replies carry per evaluation window; and returns Flower's ``Result`` (an ``AsyncResult``, which
adds the run's books). A run that cannot make progress raises ``RunFailed`` with the first
rejection's reason instead of returning the initial model.

Subclasses implement ``on_start`` (send the first jobs) and ``on_completion``.
"""

from __future__ import annotations

import io
import logging
import math
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fl_rescaled.clock import Clock
from fl_rescaled.errors import RunFailed
from fl_rescaled.layout import ModelLayout
from fl_rescaled.manager import AsyncClientManager, Completion, ManagerObserver
from fl_rescaled.metrics import ProgressBar
from fl_rescaled.stepsizes import vanilla

from .loop import Checkpointing, EvalSchedule, EvaluateFn, budgets, new_run
from .reporting import AsyncResult
from .resume import resume_run, run_fingerprint

log = logging.getLogger("flwr.fl_rescaled")

REPLIES = ("gradient", "model")


class AsyncStrategy(Strategy):
    """Base class of the asynchronous strategies: no rounds, one event at a time.

    Parameters
    ----------
    lr : float (default: 1.0)
        The cycle stepsize α: each method scales its steps so that the stepsizes it applies per
        τ_max time units add up to α (see the subclass). With ``reply="model"``, α = 1 moves the
        model per τ_max about as far as one FedAvg round.
    reply : str (default: the method's, "gradient" or "model")
        What a reply's arrays are. ``"gradient"``: a stochastic gradient g (or any direction the
        server steps against: x ← x − γ g). ``"model"``: the model y the client trained from the
        x_sent it received (what a FedAvg ClientApp returns); the server uses the pseudo-gradient
        x_sent − y in place of g, from the model the job carried. Non-float arrays of a model reply
        (a BatchNorm counter) are adopted from the latest accepted reply; they are never stepped.
    jobs_per_node : int (default: 1)
        Jobs kept in flight per worker by the methods that restart a worker at once (the ASGD
        family, FedAsync, FedBuff). Two hide a deployment's polling latency, at the cost of
        staleness. The round-based methods keep one. At most 1000.
    fraction_evaluate : float (default: 1.0)
        Fraction of the nodes that evaluate the global model with their ``@app.evaluate`` at each
        evaluation point (as FedAvg's); their aggregated metrics fill
        ``Result.evaluate_metrics_clientapp``. 0 turns federated evaluation off.
    weighted_by_key : str (default: "num-examples")
        The reply metric used as the weight when metrics are averaged.
    arrayrecord_key : str (default: "arrays")
        Key of the ArrayRecord in the messages sent to (and replies read from) the ClientApps.
    configrecord_key : str (default: "config")
        Key of the ConfigRecord in the messages sent to the ClientApps.
    max_consecutive_rejections : int, optional (default: max(20, 2n))
        The run stops with ``RunFailed`` when this many replies in a row are rejected (lost jobs
        of nodes that left do not count). It also stops when every worker has answered and no
        reply could be used.
    """

    #: Short name used on the command line and in reports.
    name = "async"
    #: What this method's ClientApp replies with by default.
    default_reply = "gradient"
    #: False for the round-based methods, which keep exactly one job per worker.
    restarts_at_once = True

    def __init__(
        self,
        *,
        lr: float = 1.0,
        reply: str | None = None,
        jobs_per_node: int = 1,
        fraction_evaluate: float = 1.0,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        max_consecutive_rejections: int | None = None,
    ) -> None:
        if isinstance(lr, bool) or not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
            raise ValueError(f"the cycle stepsize lr (α) must be positive, got {lr!r}")
        reply = self.default_reply if reply is None else reply
        if reply not in REPLIES:
            raise ValueError(f"reply must be one of {REPLIES}, got {reply!r}")
        if isinstance(jobs_per_node, bool) or not isinstance(jobs_per_node, int) or not 1 <= jobs_per_node <= 1000:
            raise ValueError(f"jobs_per_node must be an integer in 1..1000, got {jobs_per_node!r}")
        if jobs_per_node != 1 and not self.restarts_at_once:
            raise ValueError(f"{type(self).__name__} keeps one job per worker (jobs_per_node=1)")
        if not 0.0 <= fraction_evaluate <= 1.0:
            raise ValueError(f"fraction_evaluate must be in [0, 1], got {fraction_evaluate!r}")
        if max_consecutive_rejections is not None and max_consecutive_rejections < 1:
            raise ValueError("max_consecutive_rejections must be at least 1")
        self.lr = float(lr)
        self.reply = reply
        self.jobs_per_node = jobs_per_node
        self.fraction_evaluate = float(fraction_evaluate)
        self.weighted_by_key = weighted_by_key
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.max_consecutive_rejections = max_consecutive_rejections
        self.manager: AsyncClientManager | None = None
        self.layout: ModelLayout | None = None
        self.x: np.ndarray = np.zeros(0, np.float32)
        self.carried: dict[str, np.ndarray] = {}
        self._scratch: np.ndarray = self.x
        self.history: list[dict[str, Any]] = []
        self.wall_seconds = 0.0
        self.on_event: Callable[[Completion, np.ndarray], None] | None = None
        #: Batched runs (``set_replicas``): α of every replica; the strategy then runs with lr = 1
        #: and each replica's step is the unit step times its α (every stepsize rule is linear in α).
        self.replica_lrs: np.ndarray | None = None
        self.frozen_replicas: dict[int, float] = {}  # replica -> time its gradient went non-finite

    def __getstate__(self) -> dict:  # (a checkpoint: the caller's event callback stays with the caller)
        return {**self.__dict__, "on_event": None}

    def set_replicas(self, lrs: list[float]) -> None:
        """Run R replicas that differ only in α (and seed) in one event loop: the model is their
        flat vectors end to end, every event applies each replica's own step α_r · γ_unit."""
        if not lrs or any(not (a > 0 and math.isfinite(a)) for a in lrs):
            raise ValueError("every replica's α must be positive")
        self._replica_alphas = np.asarray(lrs, dtype=np.float64)
        self.replica_lrs = self._replica_alphas.copy()
        self.lr = 1.0

    # ---------------------------------------------------------------- hooks for subclasses
    @abstractmethod
    def on_start(self) -> None:
        """Send the first jobs (the manager is connected and the model is ``self.x``)."""

    @abstractmethod
    def on_completion(self, comp: Completion) -> None:
        """One accepted reply: ``comp.update`` is a direction g (a gradient or a pseudo-gradient)."""

    def on_rejected(self, comp: Completion) -> None:
        """A reply that must not touch the model: give the worker a fresh job on the current model
        (unless its node is gone: it gets one when it reappears, and a job of the node it had before
        it restarted is not replaced, since the worker got its jobs when it rejoined)."""
        assert self.manager is not None
        book = self.manager.books[comp.worker]
        if book.online and comp.job.node_id == book.node_id:
            self.submit(comp.worker)

    def on_worker_joined(self, worker: int) -> None:
        """Wall clock: a worker's node (re)appeared; give it work on the current model."""
        self.submit(worker)

    def job_config(self) -> dict | None:
        """Extra config every job of this strategy carries; default none."""
        return None

    def target_weights(self) -> Sequence[float] | None:
        """Per-partition target weights, if the method has them (then the run needs the partition query)."""
        return None

    def stored_vectors(self) -> int:
        """How many model-sized vectors the server holds besides the model (gradient memory)."""
        return 0

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.name, "lr": self.lr, "reply": self.reply}

    # ---------------------------------------------------------------- helpers
    @property
    def n(self) -> int:
        assert self.manager is not None
        return self.manager.num_workers

    def submit(self, worker: int) -> None:
        """Send ``worker`` a job on the current model (with this strategy's ``job_config``)."""
        assert self.manager is not None
        self.manager.submit(worker, self.x, self.manager.version, self.job_config(), self.carried)

    def start_jobs(self, worker: int) -> None:
        """``jobs_per_node`` jobs on the current model for ``worker`` (methods that restart at once)."""
        for _ in range(self.jobs_per_node):
            self.submit(worker)

    def vanilla_gamma(self) -> float:
        """Vanilla ASGD's step α · τ_H / (n · τ_max) over the current τ estimates: the base step of
        every method that normalises to Vanilla."""
        assert self.manager is not None
        return _VANILLA(self.lr, 0, self.manager.taus, 0)

    def apply(self, worker: int, update: np.ndarray, stepsize: float, booked: float | None = None) -> None:
        """x ← x − stepsize · update, booked as one server update triggered by ``worker``.

        ``booked`` is the stepsize entered in the cumulative-stepsize books when it differs from
        the multiplier; default ``stepsize``.
        """
        if self._scratch.shape != self.x.shape:
            self._scratch = np.empty_like(self.x)
        if self.replica_lrs is None:
            np.multiply(update, stepsize, out=self._scratch, casting="same_kind")
        else:  # each replica's step in the update's precision, as its own run would take α · γ_unit
            R = len(self.replica_lrs)
            steps = (stepsize * self.replica_lrs).astype(update.dtype)
            np.multiply(update.reshape(R, -1), steps[:, None], out=self._scratch.reshape(R, -1))
        np.subtract(self.x, self._scratch, out=self.x)
        assert self.manager is not None
        self.manager.record_update(worker, stepsize if booked is None else booked)

    # ---------------------------------------------------------------- Flower's round API
    # Asynchronous strategies have no rounds: the whole run happens inside ``start``. These four
    # methods of Flower's Strategy interface are therefore not part of their contract.
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        raise NotImplementedError(f"{type(self).__name__} is asynchronous: call start(), not rounds")

    def aggregate_train(self, server_round: int, replies):
        raise NotImplementedError(f"{type(self).__name__} is asynchronous: call start(), not rounds")

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        raise NotImplementedError(f"{type(self).__name__} is asynchronous: call start(), not rounds")

    def aggregate_evaluate(self, server_round: int, replies: list[Message]):
        raise NotImplementedError(f"{type(self).__name__} is asynchronous: call start(), not rounds")

    def summary(self) -> None:
        log.info("\t├──> %s", ", ".join(f"{k}={v}" for k, v in self.describe().items()))
        log.info("\t└──> Keys in records: weighted by '%s', ArrayRecord '%s', ConfigRecord '%s'",
                 self.weighted_by_key, self.arrayrecord_key, self.configrecord_key)

    # ---------------------------------------------------------------- the loop
    def start(  # pylint: disable=too-many-arguments,too-many-locals
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_updates: int | None = None,
        timeout: float = 3600.0,
        train_config: ConfigRecord | dict | None = None,
        evaluate_config: ConfigRecord | dict | None = None,
        evaluate_fn: EvaluateFn | None = None,
        *,
        time_budget: float | None = None,
        clock: Clock | None = None,
        taus: list[float] | None = None,
        eval_every: float | None = None,
        num_evaluations: int = 10,
        num_workers: int | None = None,
        partition_query: bool | None = None,
        progress: bool = False,
        observers: list[ManagerObserver] | None = None,
        checkpoint: Checkpointing | None = None,
        manager_options: dict[str, Any] | None = None,
    ) -> AsyncResult:
        """Run the asynchronous loop until a budget is spent; return Flower's ``Result``.

        Parameters
        ----------
        grid : Grid
            The Grid of the ServerApp (Flower's, or ``fl_rescaled.InProcessGrid``).
        initial_arrays : ArrayRecord
            The initial model, in the layout every job carries and every reply must have
            (``ArrayRecord(model.state_dict())``, say).
        num_updates : int, optional
            Stop after this many server updates (FedAvg's ``num_rounds`` becomes this or
            ``time_budget``; at least one of the two is required).
        timeout : float (default: 3600)
            Seconds a job (and an evaluation) may take before it counts as lost: every message's TTL.
        train_config, evaluate_config : ConfigRecord, optional
            Sent with every training job (with the job's tags added, see ``fl_rescaled.messages``)
            and with every federated evaluation.
        evaluate_fn : callable, optional
            Central evaluation ``evaluate_fn(step, arrays) -> MetricRecord | None``, called at the
            start (step 0), at every evaluation point and at the end.
        time_budget : float, optional
            Stop when the clock reaches this time: virtual time units, or on the wall clock
            seconds / ``time_unit`` counted from the first job sent.
        clock : VirtualClock or WallClock, optional
            Default: on ``InProcessGrid`` a virtual clock with each node's ``tau`` from its node
            config (1 if unset); on Flower's runtimes the wall clock, with τ_i estimated online.
        taus : list of float, optional
            Per-partition compute times for the default virtual clock (needs the partition query).
        eval_every : float, optional
            Evaluation period in time units. Default: ``num_evaluations`` points over the budget
            (over ``time_budget`` when given, else every ``num_updates / num_evaluations`` updates).
        num_evaluations : int (default: 10)
            Evaluation points after the start when ``eval_every`` is not given.
        num_workers : int, optional
            Use the first ``num_workers`` workers only (default: every node).
        partition_query : bool, optional
            Number the workers by ``partition-id`` (``fl_rescaled.add_partition_query`` in the
            ClientApp). Default: only when a per-partition setting (``taus``, a strategy's
            ``weights``, a per-worker job config) needs it; else the workers are the nodes in
            node-id order.
        progress : bool (default: False)
            A progress bar on stderr.
        observers : list of ManagerObserver, optional
            Told of every job sent, reply awaited, completion and update (benchmarks, metrics).
        checkpoint : Checkpointing, optional
            Write the run's whole state to ``checkpoint.path`` every ``checkpoint.every`` time units
            (atomically, books checked); with ``resume=True`` go on from the state there instead of
            starting (``strategies/resume.py``). A corrupted or foreign checkpoint raises
            ``CheckpointError``.
        manager_options : dict, optional
            Extra keyword arguments of ``AsyncClientManager`` (``tau_estimator``, ``worker_config``).

        Returns
        -------
        AsyncResult
            Flower's ``Result`` (final arrays in the initial layout, metrics keyed by evaluation
            number) plus the run's ``books``.

        Raises
        ------
        RunFailed
            When the run cannot make progress; the message names the first rejection's reason
            (for a ClientApp that raised: its own exception text).
        """
        budget, max_updates = budgets(time_budget, num_updates, eval_every, num_evaluations)
        self.layout, self.x, self.carried = ModelLayout.of(initial_arrays)
        log.info("Starting %s strategy:", type(self).__name__)
        log.info("\t├── Model: %d arrays, %d trained values (%s)", len(self.layout.entries),
                 self.layout.flat_size, self.layout.flat_dtype)
        log.info("\t├── Budget: %s", " and ".join(
            ([f"{budget:g} time units"] if time_budget is not None else [])
            + ([f"{max_updates} updates"] if max_updates is not None else [])))
        self.summary()
        bar = ProgressBar(budget if time_budget is not None else float(max_updates), enabled=progress, label=self.name)
        plan = checkpoint and run_fingerprint(self, checkpoint, self.layout, budget, max_updates)
        wall0 = time.perf_counter()
        if plan is not None and plan.resume:
            run = resume_run(self, plan, grid, evaluate_fn, evaluate_config, timeout, bar, observers)
        else:
            if eval_every is not None:
                schedule = EvalSchedule(float(eval_every), None)
            elif time_budget is not None:
                schedule = EvalSchedule(budget / num_evaluations, None)
            else:
                schedule = EvalSchedule(math.inf, max(1, math.ceil(max_updates / num_evaluations)))
            run = new_run(self, grid, clock, taus, num_workers, partition_query, dict(manager_options or {}),
                          train_config, timeout, observers, evaluate_fn, evaluate_config, schedule, bar,
                          by_time=time_budget is not None)
            run.plan_checkpoints(plan)
            wall0 = time.perf_counter()
            self.on_start()
        run.loop(budget, max_updates)
        bar.close()
        manager = self.manager
        assert manager is not None
        self.wall_seconds = time.perf_counter() - wall0
        result = run.result
        result.arrays = self.layout.to_record(self.x, self.carried)
        result.books = MetricRecord(manager.books_summary())
        try:
            manager.ledger.check_balance()  # every job sent is accounted for, per worker
        except AssertionError as exc:
            raise RunFailed(str(exc), manager.books_summary()) from None
        log.info("")
        log.info("Strategy execution finished in %.2fs", self.wall_seconds)
        for line in io.StringIO(str(result)):
            log.info("\t%s", line.rstrip("\n"))
        return result

    def freeze(self, replicas: list[int], t: float) -> None:
        """A replica whose gradient went non-finite has diverged: its model stops moving (α_r = 0)
        while the other replicas go on with the same events."""
        assert self.replica_lrs is not None
        for r in replicas:
            if r not in self.frozen_replicas:
                self.frozen_replicas[int(r)] = float(t)
                self.replica_lrs[int(r)] = 0.0
                log.warning("replica %d: non-finite gradient at t=%g; replica frozen (diverged)", r, t)


_VANILLA = vanilla()


