"""The base of every asynchronous strategy: its options, the algorithm's hooks, and the Flower façade.

A strategy is the **algorithm** of a run: it declares its options (keyword-only constructor
arguments, documented once in numpydoc), its state (a dataclass, ``State``: buffers, tables, rounds;
created when the strategy is built and again when a run starts), and what it does with one
completion at a time (``on_start``, ``on_completion``, ``on_rejected``, ``on_joined``), through the
``Run`` the driver hands it (``fl_rescaled.driver``: apply a step, send jobs). ``start`` is the
**Flower façade**: it replaces Flower's round loop with a ``Driver``, which owns the run, and
returns Flower's ``Result`` (an ``AsyncResult``, which adds the run's books).
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fl_rescaled.bounds import OUTLIER_FACTOR, Chain, of_options
from fl_rescaled.clock import Clock
from fl_rescaled.algorithm import Run
from fl_rescaled.driver import Driver
from fl_rescaled.manager import Completion, ManagerObserver, ManagerSettings
from fl_rescaled.reporting import AsyncResult, EvaluateFn
from fl_rescaled.runstate import Checkpointing
from fl_rescaled.stepsizes import vanilla

log = logging.getLogger("flwr.fl_rescaled")

REPLIES = ("gradient", "model")


@dataclass
class NoState:
    """The state of a strategy that keeps none besides the model (the ASGD family, FedAsync)."""


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
    outlier_factor : float, optional (default: 300)
        Reject an update (a reply's direction g) whose L2 norm is more than this many times the
        median of the workers' latest accepted norms (``fl_rescaled.bounds.outlier_guard``, which
        says how the start of a run is judged and what the guard cannot catch); it is booked as
        ``rejected.outlier``, the model untouched. ``none`` turns the guard off.
    adaptive_clip : float, optional (default: none)
        Clip every accepted update to an online estimate of this quantile (in (0, 1)) of the
        accepted norms (``fl_rescaled.bounds.adaptive_clip``, after Andrew et al., 2021).
    clip_norm : float, optional (default: none)
        Scale an update whose L2 norm exceeds this down to it. The only bound that also holds for
        the first reply of a run. The three apply in this order (guard, adaptive clip, clip), to
        each reply on its own; runs of batched replicas apply none.
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
        outlier_factor: float | None = OUTLIER_FACTOR,
        adaptive_clip: float | None = None,
        clip_norm: float | None = None,
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
        self.outlier_factor, self.adaptive_clip, self.clip_norm = outlier_factor, adaptive_clip, clip_norm
        self.update_bound()  # (validates them)
        #: The algorithm's state (``State``); a run starts with a fresh one (``init_state``).
        self.state: Any = self.State()
        #: The driver of the last run started (its manager, books and state stay readable after it).
        self.last_run: Driver | None = None

    # ---------------------------------------------------------------- the algorithm
    #: The dataclass of this algorithm's state.
    State: type = NoState

    def init_state(self, run: Run) -> Any:
        """A fresh state for a run of ``run.n`` workers on the model ``run.x``."""
        del run
        return self.State()

    def check_state(self, state: Any, n: int, x: np.ndarray) -> None:
        """Raise ValueError when ``state`` (read from a checkpoint) does not fit ``n`` workers and the
        model ``x`` (array shapes and ranges the schema cannot say)."""

    def on_start(self, run: Run) -> None:
        """Send the first jobs: ``jobs_per_node`` jobs to every worker (the methods that restart at once)."""
        for worker in range(run.n):
            self.on_joined(run, worker)

    def on_completion(self, run: Run, comp: Completion) -> None:
        """One accepted reply: ``comp.update`` is a direction g (a gradient or a pseudo-gradient)."""
        raise NotImplementedError

    def on_rejected(self, run: Run, comp: Completion) -> None:
        """A reply that must not touch the model: its worker's slot gets a fresh job on the current
        model (unless its node is gone: it gets one when it reappears, and a job of the node it had
        before it restarted is not replaced, since the worker got its jobs when it rejoined)."""
        if run.is_online(comp.worker) and comp.job.node_id == run.node_of(comp.worker):
            run.send_next(comp.worker)

    def on_joined(self, run: Run, worker: int) -> None:
        """A worker's node (re)appeared (wall clock), or the run starts: ``jobs_per_node`` jobs for it."""
        for _ in range(self.jobs_per_node):
            run.send(worker)

    def job_config(self) -> dict | None:
        """Extra config every job of this strategy carries; default none."""
        return None

    def target_weights(self) -> Sequence[float] | None:
        """Per-partition target weights, if the method has them (then the run needs the partition query)."""
        return None

    def stored_vectors(self) -> int:
        """How many model-sized vectors the server holds besides the model (gradient memory)."""
        return 0

    def update_bound(self) -> Chain:
        """The bounds every update passes before ``on_completion`` (``fl_rescaled.bounds``)."""
        return of_options(clip_norm=self.clip_norm, adaptive_quantile=self.adaptive_clip,
                          outlier_factor=self.outlier_factor)

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.name, "lr": self.lr, "reply": self.reply, "outlier_factor": self.outlier_factor,
                "adaptive_clip": self.adaptive_clip, "clip_norm": self.clip_norm}

    def local_lr(self, gamma_v: float, steps: int) -> float:
        """The local learning rate of ``steps`` local SGD steps per job (model replies) under the α
        convention, given Vanilla ASGD's step γ_V: here 1 / H, so that the pseudo-gradient is the
        mean of the H local gradients and the server's own stepsize stays the method's."""
        del gamma_v
        return 1.0 / steps

    @staticmethod
    def vanilla_gamma(lr: float, run: Run) -> float:
        """Vanilla ASGD's step α · τ_H / (n · τ_max) over the current τ estimates: the base step of
        every method that normalises to Vanilla."""
        return _VANILLA(lr, 0, run.taus, 0)

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
        settings: ManagerSettings | None = None,
        replicas: Sequence[float] | None = None,
        seed: int = 0,
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
            starting. A corrupted, foreign or hostile checkpoint raises ``CheckpointError``.
        settings : ManagerSettings, optional
            The client manager's settings (``fl_rescaled.manager.ManagerSettings``: how τ is
            estimated on the wall clock, how often Flower's Grid is polled, ...).
        replicas : sequence of float, optional
            Run R replicas that differ only in α in one event loop (``experiment.run_batch``): the
            model is their flat vectors end to end and each event applies replica r's step
            α_r · γ, with γ the step of α = 1 (every stepsize rule is linear in α; build the
            strategy with ``lr=1``).
        seed : int (default: 0)
            Seeds the run's own random choices (Concurrent ASGD's worker draws, unless its ``seed``
            option is set).

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
        driver = Driver(self, grid, initial_arrays, num_updates=num_updates, time_budget=time_budget,
                        timeout=timeout, train_config=train_config, evaluate_config=evaluate_config,
                        evaluate_fn=evaluate_fn, clock=clock, taus=taus, eval_every=eval_every,
                        num_evaluations=num_evaluations, num_workers=num_workers, partition_query=partition_query,
                        progress=progress, observers=observers, checkpoint=checkpoint, settings=settings,
                        replicas=replicas, seed=seed)
        self.last_run = driver
        layout = driver.layout
        log.info("Starting %s strategy:", type(self).__name__)
        log.info("\t├── Model: %d arrays, %d trained values (%s)", len(layout.entries), layout.flat_size,
                 layout.flat_dtype)
        log.info("\t├── Budget: %s", " and ".join(
            ([f"{driver.budget:g} time units"] if time_budget is not None else [])
            + ([f"{driver.max_updates} updates"] if driver.max_updates is not None else [])))
        self.summary()
        result = driver.run()
        log.info("")
        log.info("Strategy execution finished in %.2fs", driver.wall_seconds)
        for line in io.StringIO(str(result)):
            log.info("\t%s", line.rstrip("\n"))
        return result


_VANILLA = vanilla()


