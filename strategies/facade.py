"""The Flower façade of an asynchronous strategy: ``start`` runs the whole run, rounds are refused.

``FlowerFacade`` is the part of ``AsyncStrategy`` that Flower sees: a ``flwr.serverapp.strategy.Strategy``
whose ``start(grid=..., initial_arrays=...)`` builds a ``Driver`` for the strategy, runs it and
returns Flower's ``Result`` (an ``AsyncResult``), and whose round hooks (``configure_train``, ...)
raise: there are no rounds to configure. The algorithm (options, state, what one completion does)
is ``AsyncStrategy``'s (``strategies/base.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fl_rescaled.clock import Clock
from fl_rescaled.divergence import Divergence
from fl_rescaled.driver import Driver
from fl_rescaled.manager import ManagerObserver, ManagerSettings
from fl_rescaled.reporting import AsyncResult, EvaluateFn
from fl_rescaled.runstate import Checkpointing

from .checks import no_round_hooks, no_rounds, refuse_round_wrapper

log = logging.getLogger("flwr.fl_rescaled")


class FlowerFacade(Strategy):
    """What Flower calls: ``start``, and the round hooks that refuse to run (see the module docstring)."""

    # ---------------------------------------------------------------- Flower's round API
    # No rounds: a run happens inside ``start``; a subclass that overrides these four is refused.
    configure_train = aggregate_train = configure_evaluate = aggregate_evaluate = no_rounds

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        no_round_hooks(cls)

    def summary(self) -> None:
        """The strategy's options in the log, drawn as FedAvg's ``summary`` draws its own."""
        # (Flower's DP wrappers call this from their start(), before their first round: refused there)
        refuse_round_wrapper(self)
        options = list(self.describe().items())
        log.info("\t├──> Options:")
        for i, (key, value) in enumerate(options):
            log.info("\t│\t%s── %s: %s", "└" if i == len(options) - 1 else "├", key, value)
        log.info("\t├──> Sampling:")
        log.info("\t│\t├──Fraction: evaluate (%.2f)", self.fraction_evaluate)
        log.info("\t│\t├──Minimum nodes: evaluate (%d)", self.min_evaluate_nodes)
        log.info("\t│\t└──Minimum available nodes: %d", self.min_available_nodes)
        log.info("\t└──> Keys in records:")
        log.info("\t\t├── Weighted by: '%s'", self.weighted_by_key)
        log.info("\t\t├── ArrayRecord key: '%s'", self.arrayrecord_key)
        log.info("\t\t└── ConfigRecord key: '%s'", self.configrecord_key)

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
        num_trainings: int | None = None,
        time_budget: float | None = None,
        clock: Clock | None = None,
        taus: list[float] | None = None,
        eval_every: float | None = None,
        num_evaluations: int | None = None,
        num_workers: int | None = None,
        partition_query: bool | None = None,
        progress: bool = False,
        observers: list[ManagerObserver] | None = None,
        checkpoint: Checkpointing | None = None,
        settings: ManagerSettings | None = None,
        replicas: Sequence[float] | None = None,
        seed: int = 0,
        divergence: Divergence | None = Divergence(),
        finish_in_flight: bool = False,
        num_rounds: int | None = None,
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
            Stop after this many server updates (one FedBuff update is K trainings, one FedAsync
            update one). Give one of ``num_rounds``, ``num_trainings`` and ``num_updates``, not two
            (``ValueError``); at least one of them or ``time_budget`` is required.
        timeout : float (default: 3600)
            Seconds a job (and an evaluation) may take before it counts as lost: every message's TTL.
        train_config, evaluate_config : ConfigRecord, optional
            Sent with every training job (with the job's tags added, see ``fl_rescaled.messages``)
            and with every federated evaluation.
        evaluate_fn : callable, optional
            Central evaluation ``evaluate_fn(step, arrays) -> MetricRecord | None``, called at the
            start (step 0), at every evaluation point and at the end.
        num_trainings : int, optional
            Stop after this many client trainings, the unit of FedAvg's work: FedAvg's
            ``num_rounds × clients per round`` (``num_rounds=3`` with 12 nodes per round is
            ``num_trainings=36``), the same for every strategy (FedBuff with K = 10: 120 trainings are
            12 updates; FedAsync: 120 updates). A training counts when its reply reaches the server,
            accepted or rejected (the client did the work; the books say why a reply was rejected); a
            lost job (no reply, an error reply) does not. The jobs still in flight when the budget is
            reached are not waited for (unless ``finish_in_flight``): ``Result.books["in-flight"]``
            and the log count them.
        num_rounds : int, optional
            FedAvg's budget, kept: the work of that many FedAvg rounds, ``num_rounds × C`` client
            trainings, with C FedAvg's clients per round for the nodes there are at the start
            (max(``min_train_nodes``, ⌊``fraction_train`` · nodes⌋), or ``concurrency``), so the
            switch from FedAvg keeps its line and does FedAvg's work on any number of nodes. With
            the default evaluations the ``Result``'s keys 1 … ``num_rounds`` are where FedAvg's
            rounds would end. There are no rounds: the jobs run as above.
        time_budget : float, optional
            Stop when the clock reaches this time: virtual time units, or on the wall clock
            seconds / ``time_unit`` counted from this call, as FedAvg's execution time is (the nodes'
            start-up, Ray's or a SuperNode's, is in it: the log's first time stamps show it).
        clock : VirtualClock or WallClock, optional
            Default: on ``InProcessGrid`` a virtual clock with each node's ``tau`` from its node
            config (1 if unset); on Flower's runtimes the wall clock, with τ_i estimated online.
        taus : list of float, optional
            Per-partition compute times for the default virtual clock (needs the partition query).
        eval_every : float, optional
            Evaluation period in time units. Default: an evaluation point after every round's worth
            of client trainings, C = FedAvg's clients per round (``max(min_train_nodes,
            ⌊fraction_train · N⌋)``, or ``concurrency``): ``evaluate_fn`` at the start and at every
            point, and the federated evaluation of ``fraction_evaluate`` of the nodes at every point
            after the start, as FedAvg evaluates once per round. So a run costs FedAvg's evaluations
            for the same trainings, whatever its budget's unit.
        num_evaluations : int, optional
            Instead: this many evaluation points after the start, spread over the budget (over
            ``time_budget`` when given, else every ``num_updates / num_evaluations`` updates or
            ``num_trainings / num_evaluations`` trainings).
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
        divergence : Divergence, optional (default: 10 × the initial loss at 3 points in a row)
            When the evaluated loss (``evaluate_fn``'s, else the federated evaluation's) counts as a
            diverged model: non-finite, or above ``factor`` × its value at the start at ``points``
            evaluation points in a row (``fl_rescaled.divergence``); the run then fails with the best
            model so far in ``RunFailed.result``. None: never (a sweep that records divergence).
        finish_in_flight : bool (default: False)
            When a budget is spent, wait for the jobs still in flight (each at most its ``timeout``)
            and use their replies as any other, sending no new job: the clients' work is not thrown
            away, and the run ends a little past its budget (up to one job per slot more trainings,
            later than ``time_budget``; a FedBuff buffer they do not fill stays unapplied, as at any
            end). Default: the run ends at its budget, and those jobs are counted, not applied (on
            Flower's runtimes their replies are left to the SuperLink). A private run whose clients
            are out of privacy budget never waits (their replies must not be applied).

        Returns
        -------
        AsyncResult
            Flower's ``Result`` (final arrays in the initial layout, metrics keyed by round as
            FedAvg's: 0 the start, then one key per evaluation point) plus each point's time,
            trainings and updates (``progress``) and the run's ``books`` (``AsyncResult``).

        Raises
        ------
        RunFailed
            When the run cannot make progress (the message names the first rejection's reason; for
            a ClientApp that raised, its own exception text), or its model diverged (the message
            names the clients whose updates were largest; ``RunFailed.result`` has the best model).
        """
        return Driver(self, grid, initial_arrays, num_updates=num_updates, num_trainings=num_trainings,
                      num_rounds=num_rounds,
                      time_budget=time_budget,
                      timeout=timeout, train_config=train_config, evaluate_config=evaluate_config,
                      evaluate_fn=evaluate_fn, clock=clock, taus=taus, eval_every=eval_every,
                      num_evaluations=num_evaluations, num_workers=num_workers, partition_query=partition_query,
                      progress=progress, observers=observers, checkpoint=checkpoint, settings=settings,
                      replicas=replicas, seed=seed, divergence=divergence, finish_in_flight=finish_in_flight).run()
