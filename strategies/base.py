"""The base of every asynchronous strategy: its options, the algorithm's hooks, and the Flower façade.

A strategy is the **algorithm** of a run: it declares its options (keyword-only constructor
arguments, documented once in numpydoc), its state (a dataclass, ``State``: buffers, tables, rounds;
created when the strategy is built and again when a run starts), and what it does with one
completion at a time (``on_start``, ``on_completion``, ``on_rejected``, ``on_joined``), through the
``Run`` the driver hands it (``fl_rescaled.driver``). The **Flower façade** it inherits
(``FlowerFacade``, ``strategies/facade.py``) has ``start``: it replaces Flower's round loop with a
``Driver`` and returns Flower's ``Result`` (an ``AsyncResult``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fl_rescaled.algorithm import Completion, Run
from fl_rescaled.bounds import CLIP_FACTOR, OUTLIER_FACTOR, BoundOptions
from fl_rescaled.manager.selection import PopulationOptions
from fl_rescaled.reporting import EvaluationOptions
from fl_rescaled.run_api import RunOptions
from fl_rescaled.stepsizes import vanilla

from .checks import check_common
from .facade import FlowerFacade

log = logging.getLogger("flwr.fl_rescaled")


@dataclass
class NoState:
    """The state of a strategy that keeps none besides the model (the ASGD family, FedAsync)."""


class AsyncStrategy(FlowerFacade):
    """Base class of the asynchronous strategies: no rounds, one event at a time.

    Parameters
    ----------
    lr : float, optional (default: the method's, 1)
        The cycle stepsize α: each method scales its steps so that the stepsizes it applies per
        τ_max time units add up to α (see the subclass). Default 1, except where a method says
        otherwise (Rescaled ASGD with model replies).
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
    min_evaluate_nodes : int (default: 2)
        FedAvg's: the least number of nodes that evaluate (at most every online node).
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
    concurrency : int, optional (default: every node)
        C, the most jobs in flight across the N workers. With C < N a freed slot goes to the idle,
        online worker that ``selection`` picks: a federated population, C training at a time.
        Default: from ``fraction_train``.
    selection : str (default: "uniform")
        With C < N: ``"uniform"`` (seeded draws), ``"round-robin"`` (seeded turns: cyclic
        participation), or your own ``IdleSelector`` by its name in ``fl_rescaled.manager.SELECTORS``.
    fraction_train : float (default: 1.0)
        FedAvg's: when ``concurrency`` is not given, C = max(min_train_nodes, ⌊fraction_train · N⌋),
        as FedAvg counts the nodes of a round (1.0: every node trains all the time).
    min_train_nodes : int (default: 2)
        FedAvg's: the least C that ``fraction_train`` may give.
    min_available_nodes : int (default: 1)
        FedAvg's: wait for this many nodes before the first job (FedAvg's default is 2; an
        asynchronous run can start with one).
    train_metrics_aggr_fn : callable, optional
        FedAvg's: ``fn(list[RecordDict], weighted_by_key) -> MetricRecord`` aggregates the metrics of
        the replies of each evaluation window (default: FedAvg's weighted average, lists element
        by element, the weight key left out).
    evaluate_metrics_aggr_fn : callable, optional
        FedAvg's: the same for the federated evaluation's replies.
    outlier_factor : float, optional (default: 300)
        Reject an update (a reply's direction g) whose L2 norm is more than this many times the
        median of the workers' latest accepted norms (``fl_rescaled.bounds.outlier_guard``, which
        says how the start of a run is judged and what the guard cannot catch); it is booked as
        ``rejected.outlier``, the model untouched. ``none`` turns the guard off.
    clip_factor : float, optional (default: 1.5)
        Scale an update down so that its client moves the model, per unit of time, at most this
        many times as far as the upper median of the other workers' latest updates do
        (``fl_rescaled.peer_bounds.median_clip``: each norm weighted by the strategy's
        ``influence``). A client whose updates stay far above the others' (a moving ratio above 8
        after 20 judged, ``fl_rescaled.manager.reputation``) is named and set aside. It keeps one
        lying client of four, or a quarter of them, from outweighing the honest ones
        (``docs/reliability.md``); ``none`` turns it off.
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
    #: Whether the steps follow each worker's τ (the τ-proportional rules; a warning says when all τ are equal).
    uses_tau = False
    #: What one ``Run.apply`` releases, for differential privacy (``strategies/dp.py``): "sum", a
    #: weighted sum (weights ≤ 1) of the updates accepted since the last apply; None: not supported.
    dp_release: str | None = None
    #: Whether ``lr`` (α) sets the steps (False: the clients' own learning rate does; not shown as a setting).
    uses_lr = True

    def __init__(
        self,
        *,
        lr: float | None = None,
        reply: str | None = None,
        jobs_per_node: int = 1,
        fraction_evaluate: float = 1.0,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        max_consecutive_rejections: int | None = None,
        concurrency: int | None = None,
        selection: str = "uniform",
        fraction_train: float = 1.0,
        min_train_nodes: int = 2,
        min_available_nodes: int = 1,
        min_evaluate_nodes: int = 2,
        train_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
        evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
        outlier_factor: float | None = OUTLIER_FACTOR,
        clip_factor: float | None = CLIP_FACTOR,
        adaptive_clip: float | None = None,
        clip_norm: float | None = None,
    ) -> None:
        reply = self.default_reply if reply is None else reply
        check_common(type(self).__name__, self.restarts_at_once, lr=lr, reply=reply, jobs_per_node=jobs_per_node,
                     fraction_evaluate=fraction_evaluate, max_consecutive_rejections=max_consecutive_rejections,
                     concurrency=concurrency, selection=selection, fraction_train=fraction_train,
                     min_train_nodes=min_train_nodes, min_available_nodes=min_available_nodes,
                     min_evaluate_nodes=min_evaluate_nodes,
                     train_metrics_aggr_fn=train_metrics_aggr_fn, evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn)
        # The algorithm's own options:
        self.lr = 1.0 if lr is None else float(lr)
        self.lr_given = lr is not None  # (else the method's default, which may depend on the run)
        self.reply, self.jobs_per_node = reply, jobs_per_node
        # The options of the parts that use them, each group declared in its part (and readable and
        # settable here under its FedAvg name, as on Flower's strategies: ``OPTION_GROUPS``):
        self.population = PopulationOptions(None if concurrency is None else int(concurrency), selection,
                                            float(fraction_train), int(min_train_nodes), int(min_available_nodes))
        self.evaluation = EvaluationOptions(float(fraction_evaluate), int(min_evaluate_nodes), weighted_by_key,
                                            train_metrics_aggr_fn, evaluate_metrics_aggr_fn)
        self.bounds = BoundOptions(outlier_factor, clip_factor, adaptive_clip, clip_norm)
        self.bounds.chain()  # (validates them)
        self.run_options = RunOptions(arrayrecord_key, configrecord_key, max_consecutive_rejections)

    # ---------------------------------------------------------------- the algorithm
    #: The dataclass of this algorithm's state. The strategy creates one per run (``init_state``);
    #: the run keeps it (``run.strategy_state``, part of its checkpoints) and hands it back to every
    #: hook through ``run``: a strategy object holds no state of any run, so one can run many.
    State: type = NoState

    def init_state(self, run: Run) -> Any:
        """A fresh state for a run of ``run.n`` workers on the model ``run.x``."""
        del run
        return self.State()

    def check_state(self, state: Any, n: int, x: np.ndarray) -> None:
        """Raise ValueError when ``state`` (read from a checkpoint) does not fit ``n`` workers and the
        model ``x`` (array shapes and ranges the schema cannot say)."""

    def on_start(self, run: Run) -> None:
        """Send the first jobs: ``jobs_per_node`` jobs to every worker (the methods that restart at once);
        with C < N, C jobs, each to a worker the selection picks."""
        if run.concurrency < run.n:
            for _ in range(run.concurrency):
                run.send_next(None)
            return
        for worker in run.online_workers():
            self.on_joined(run, worker)

    def on_completion(self, run: Run, comp: Completion) -> None:
        """One accepted reply: ``comp.update`` is a direction g (a gradient or a pseudo-gradient)."""
        raise NotImplementedError

    def on_rejected(self, run: Run, comp: Completion) -> None:
        """A reply that must not touch the model: its slot gets a fresh job on the current model. With
        C = N that is its worker's, unless its node is gone (it gets one when it comes back); a job
        of the node a worker had before it restarted is not replaced (the worker got its jobs when
        it rejoined)."""
        if comp.job.node_id == run.node_of(comp.worker):
            run.send_next(comp.worker)  # (to the same worker if it is online, with C = N)

    def on_joined(self, run: Run, worker: int) -> None:
        """A worker's node (re)appeared (wall clock), or the run starts: ``jobs_per_node`` jobs for it."""
        for _ in range(self.jobs_per_node):
            run.send(worker)

    def configure_job(self, config: ConfigRecord, *, updates: int, time: float) -> ConfigRecord:
        """The config of the next job: ``train_config`` as given to ``start`` (a copy), changed as the
        strategy wants. The asynchronous counterpart of FedAvg's ``configure_train``: override it for a
        learning-rate schedule by the number of server updates so far (``updates``, FedAvg's
        ``server_round - 1``) or by the run's ``time``. The job's tags are added after. Default: as is."""
        del updates, time
        return config

    @property
    def configures_jobs(self) -> bool:
        """Whether ``configure_job`` is overridden (else no per-job config is built)."""
        return type(self).configure_job is not AsyncStrategy.configure_job

    def on_evaluation(self, step: int, arrays: ArrayRecord, metrics: dict[str, MetricRecord]) -> None:
        """Called at every evaluation point, in order, once its evaluations are done: ``step`` is its
        number, ``arrays`` the model there, ``metrics`` its records by name (``train``, ``server``:
        what ``evaluate_fn`` returned, ``federated``, ``progress``: time and updates). Override it to
        save the best model or append to a results file (FedAvg users do it in ``evaluate_fn``;
        both work). Default: nothing."""

    def influence(self, run: Run, worker: int) -> float:
        """How far a reply of ``worker`` moves the model per unit of time, relative to the other
        workers' (up to a factor common to all): the weight the median clip gives a norm
        (``fl_rescaled.peer_bounds``). Default: its delivery rate 1 / p_i, every reply counting alike.
        A method whose steps give every worker its share whatever its speed (the round-based ones)
        returns 1."""
        return 1.0 / run.periods.period(worker)

    def target_weights(self) -> Sequence[float] | None:
        """Per-partition target weights, if the method has them (then the run needs the partition query)."""
        return None

    def stored_vectors(self, state: Any) -> int:
        """How many model-sized vectors the server holds besides the model (gradient memory), with
        the algorithm's ``state``."""
        del state
        return 0

    def report(self, state: Any) -> dict[str, Any]:
        """What the run reports of the algorithm's ``state`` at each evaluation and in its result
        (a private run: its ``"dp"`` object). Default: nothing."""
        del state
        return {}

    def stopped(self, state: Any) -> str | None:
        """Why the run must stop now (a private run whose clients are out of budget). Default: never."""
        del state
        return None

    #: ``admits(state, worker)``: whether the selection (C < N) may give ``worker`` a job (a private
    #: run's budgets). None: every worker may.
    admits = None

    @property
    def lr_per_run(self) -> bool:
        """True when ``lr`` was not given and the method's default α depends on the run."""
        return False

    def describe(self) -> dict[str, Any]:
        lr = "the run's default" if self.lr_per_run else self.lr
        out = {"strategy": self.name, **({"lr": lr} if self.uses_lr else {}), "reply": self.reply,
               "outlier_factor": self.outlier_factor, "clip_factor": self.clip_factor,
               "adaptive_clip": self.adaptive_clip, "clip_norm": self.clip_norm}
        if self.concurrency is not None or self.fraction_train != 1.0:
            out.update(concurrency=self.concurrency, fraction_train=self.fraction_train)
        return {**out, "selection": self.selection} if self.selection != "uniform" else out

    def local_lr(self, gamma_v: float, steps: int, n: int = 1) -> float:
        """The local learning rate of ``steps`` local SGD steps per job (model replies) under the α
        convention, given Vanilla ASGD's step γ_V: here 1 / H, so that the pseudo-gradient is the
        mean of the H local gradients and the server's own stepsize stays the method's."""
        del gamma_v, n
        return 1.0 / steps


_VANILLA = vanilla()

#: The option groups of a strategy, by attribute: each keyword of the constructor that belongs to a
#: part of the run (the population, the evaluations, the update bounds, the driver) is a field of
#: that part's group, and is readable and settable on the strategy under its own name too, as on
#: Flower's FedAvg (``strategy.fraction_evaluate``).
OPTION_GROUPS: dict[str, type] = {"population": PopulationOptions, "evaluation": EvaluationOptions,
                                  "bounds": BoundOptions, "run_options": RunOptions}


def _forwarded(group: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, group), name),
                    lambda self, value: setattr(getattr(self, group), name, value),
                    doc=f"The ``{name}`` option (``self.{group}.{name}``).")


for _group, _options in OPTION_GROUPS.items():
    for _field in fields(_options):
        setattr(AsyncStrategy, _field.name, _forwarded(_group, _field.name))


