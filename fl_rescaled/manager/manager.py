"""The asynchronous client manager: jobs out to workers, completions back, every job in the books.

A strategy (through the driver) asks the manager to ``send`` a job (the model of a version) to a
worker, or to ``send_next`` one to whichever worker the selection seam picks, and for the
``next_completion``. The manager composes:

- a completion source chosen once, at construction, by the clock (``CompletionSource``,
  ``source.py``): ``VirtualSource`` (a heap of finishing times on the virtual clock) or
  ``WallSource`` (arrivals, TTLs, nodes that come and go, τ estimated online). Every decision that
  depends on the clock is the source's; the manager makes none;
- ``Transport``: jobs out as Flower Messages, replies in, matched by ``reply_to_message_id``;
- ``Membership``: which node is which worker;
- ``Books``: the one writer of every job's outcome;
- ``Population``: who gets the next job (N workers, at most C jobs in flight).

Here a validated reply becomes an update (``reply="model"``: the pseudo-gradient x_sent − y) and
passes the strategy's bounds (``fl_rescaled.bounds``: a rejected outlier is a rejection like any
other); a worker whose last ``SET_ASIDE_AFTER`` jobs all failed is set aside (``strike_out``); the
manager's part of the run's state (``ManagerState``) is written (``state``) and, each part checking
what it restores, read back (``resume``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message

from fl_rescaled.algorithm import Completion, Job
from fl_rescaled.bounds import Chain
from fl_rescaled.clock import VirtualClock, WallClock
from fl_rescaled.errors import RejectedReply, failure_text
from fl_rescaled.grid_api import AsyncGrid
from fl_rescaled.layout import ModelLayout, decode_array

from .books import DETAIL_LIMIT, Books, is_lost, is_strike, outcome_of
from .jobs import NODE_GONE
from .membership import Membership
from .observers import ManagerObserver
from .replies import update_of
from .reputation import SET_ASIDE_AFTER, strike_out, suspect
from .selection import Population
from .settings import ManagerSettings
from .source import CompletionSource
from .state import ManagerState, check_jobs
from .transport import Transport
from .virtual import VirtualSource
from .wall import WallSource

log = logging.getLogger("flwr.fl_rescaled")

_LOST_DETAIL = {"ttl-expired": "no reply within the job's TTL", "offline": "its client went offline before it finished"}


class AsyncClientManager:
    """Runs jobs on Flower nodes for an asynchronous strategy; see the module docstring.

    ``layout``: the model's ``ModelLayout``; jobs carry the model in it and replies are checked
    against it. ``reply``: what a reply's arrays are, ``"gradient"`` (g itself) or ``"model"`` (the
    trained model y). Either way a completion's ``update`` is a direction g for x ← x − γ g.
    """

    def __init__(self, grid: AsyncGrid, clock: VirtualClock | WallClock, *, layout: ModelLayout,
                 reply: str = "gradient", arrayrecord_key: str = "arrays", configrecord_key: str = "config",
                 train_config: dict[str, Any] | None = None, ttl: float = 3600.0,
                 settings: ManagerSettings | None = None, observers: list[ManagerObserver] | None = None,
                 replicas: int = 1, bound: Chain | None = None) -> None:
        if reply not in ("gradient", "model"):
            raise ValueError(f"reply must be 'gradient' or 'model', got {reply!r}")
        self.clock = clock
        self.layout = layout
        self.reply = reply
        self.train_config = dict(train_config or {})
        settings = settings or ManagerSettings()
        self.worker_config = settings.worker_config  # extra per-worker job config (e.g. emulated τ_i)
        self.observers: list[ManagerObserver] = list(observers or [])
        self.replicas = replicas  # batched runs: the model is this many replicas end to end
        self.bound = bound if replicas == 1 and bound is not None and bound.bounds else None  # (off for batches)
        self.bound_state = self.bound.init() if self.bound is not None else []
        self._norm: tuple[Completion, float | None] | None = None  # (validate -> apply_bounds: the norm measured)
        #: worker → how far its replies move the model per unit of time, relative to the others' (the
        #: strategy's ``influence``, set by the driver): the weight the median clip gives a norm
        self.influence: Callable[[int], float] = lambda worker: 1.0
        self.books = Books()
        self.transport = Transport(grid, ttl=ttl, arrayrecord_key=arrayrecord_key, configrecord_key=configrecord_key)
        self.transport.on_stray = lambda reason: self.books.record_stray(reason)
        self.transport.on_cancelled_reply = self._cancelled_reply
        self.membership = Membership(grid, self.transport, ttl=ttl, node_refresh=settings.node_refresh)
        self.membership.has_jobs = lambda worker: bool(self.books.in_flight[worker])
        self.membership.on_online = self._set_active
        self.source: CompletionSource = (  # (the one choice that depends on the clock)
            VirtualSource(clock, self.transport, self.membership, self.observers,
                          tau_smoothing=settings.tau_smoothing) if clock.virtual else
            WallSource(clock, self.transport, self.membership, tau_estimator=settings.tau_estimator,
                       tau_smoothing=settings.tau_smoothing, poll_interval=settings.poll_interval))
        self.population = Population(1, 1, 0, self.is_online, self.source.online_mask)
        self._next_job_id = 0
        self._encoded: tuple[int, ArrayRecord] | None = None  # (version, encoded model)
        self.too_many_failing = ""  # why no more workers can be set aside (the run's failure checks stop it)

    # ------------------------------------------------------------------ workers
    num_workers = property(lambda self: self.books.n)
    version = property(lambda self: self.books.version)
    #: What the stepsize rules read as τ_i: each worker's mean time between deliveries p_i (the source's).
    periods = property(lambda self: self.source.periods)
    #: Each worker's mean compute time τ_i (``periods`` itself when every worker is always busy).
    compute_times = property(lambda self: self.source.compute_times)

    def connect(self, num_workers: int | None = None, timeout: float = 120.0, *, partition_query: bool = False,
                weights: list[float] | None = None, min_nodes: int = 1) -> list[int]:
        """Wait for the nodes and number them as workers; return the node ids in worker order.

        ``partition_query``: number the workers by the partition each node says it holds (a node
        that does not answer fails the run with a clear message); else in node-id order.
        ``weights``: target weights per worker, for the stepsize rules (``TauTable``). ``min_nodes``:
        wait for at least this many nodes (FedAvg's ``min_available_nodes``).
        """
        order = self.membership.connect(num_workers, timeout, partition_query, min_nodes)
        self.books = Books.sized(len(order))
        self.source.tables(len(order), weights)
        return order

    def populate(self, concurrency: int | None, seed: int, weights: list[float] | None = None,
                 selection: str = "uniform") -> None:
        """At most ``concurrency`` jobs in flight (None: one slot per worker); with fewer slots than
        workers, a freed slot's next worker is picked by ``selection`` (``SELECTORS``) with ``seed``.
        With C < N, or an availability model, the table the stepsize rules read (``taus``) holds each
        worker's mean time between deliveries p_i = 1 / f_i: estimated from the deliveries, from the
        mean-field value of the compute-time model (``delivery_periods``; τ_i at C = N, where a client
        busy whenever online delivers less often than that by its share of time online);
        ``compute_times`` keeps the compute times τ_i. With C = N and every client always online
        p_i = τ_i exactly, and ``periods`` is ``compute_times``."""
        n = self.num_workers
        self.population = Population(n, n if concurrency is None else concurrency, seed, self.is_online,
                                     self.source.online_mask, selection)
        self.source.populate(self.population, weights)

    def online_workers(self) -> list[int]:
        return self.source.online_workers()

    def is_online(self, worker: int) -> bool:
        return self.source.is_online(worker)

    def _set_active(self, worker: int, active: bool) -> None:
        """A worker counts in the τ statistics (both tables) only while online and not set aside."""
        for table in {id(t): t for t in (self.periods, self.compute_times)}.values():
            table.set_active(worker, active)

    # ------------------------------------------------------------------ jobs
    def send(self, worker: int, model: np.ndarray, version: int, config: dict | None = None,
             carried: dict[str, np.ndarray] | None = None) -> Job:
        """Send ``worker`` a job on ``model`` (the flat float vector of server version ``version``,
        with the non-float arrays ``carried``). A model of the version last encoded is not
        serialised again. If the worker is still busy the job queues behind its current ones."""
        encoded = self._encoded
        if encoded is None or encoded[0] != version:
            encoded = self._encoded = (version, self.layout.encode(model, carried or {}))
        return self._push(worker, version, encoded[1], config)

    def send_next(self, after: int, model: np.ndarray, version: int, config: dict | None = None,
                  carried: dict[str, np.ndarray] | None = None) -> Job | None:
        """A job on ``model`` for the worker the selection picks after ``after``'s job ended (None:
        the run's first jobs). With C < N, when no idle worker is online, the slot waits: it is filled
        when one is (``refill``)."""
        worker = self.population.next_worker(after)
        if worker is None:
            self.source.no_worker(self.population, after)
            return None
        return self.send(worker, model, version, config, carried)

    @property
    def waiting(self) -> bool:
        """Workers came back (``joined``), or slots that waited for one can be filled now."""
        return bool(self.membership.joined) or self.source.woken > 0

    def refill(self, model: np.ndarray, version: int, config: dict | None = None,
               carried: dict[str, np.ndarray] | None = None) -> None:
        """Fill the slots that waited for a worker to come online (C < N)."""
        self.source.take_woken()
        for _ in range(self.population.take_parked()):
            self.send_next(None, model, version, config, carried)

    def resend(self, job: Job, config: dict | None = None) -> Job:
        """Give ``job``'s worker another job on the model ``job`` carried (same version, not re-encoded)."""
        assert job.model is not None
        return self._push(job.worker, job.version, job.model, config)

    def model_of(self, job: Job) -> np.ndarray:
        """The flat model a job was computed on (read-only when the model is one float array)."""
        assert job.model is not None
        return self.layout.flatten(job.model)[0]

    def _push(self, worker: int, version: int, model: ArrayRecord, config: dict | None) -> Job:
        seq = self.books.sent(worker)
        job = Job(self._next_job_id, worker, version, seq, self.clock.now, model=model,
                  node_id=self.membership.roster.node_ids[worker])
        self._next_job_id += 1
        tag = {"job-id": job.job_id, "worker": worker, "version": version, "job-seq": seq, "server-round": version + 1}
        if self.worker_config is not None:
            tag.update(self.worker_config[worker])
        job.config = {**self.train_config, **config, **tag} if config else {**self.train_config, **tag}
        self.population.selector.busy(worker)
        self.transport.push_job(job, read=self.source.dispatched(job))
        for obs in self.observers:
            obs.job_sent(job)
        return job

    def cancel(self, job: Job) -> None:
        """Stop a job in flight; its work so far is booked as discarded.

        On the virtual clock the worker is free at once. A transport cannot stop a remote
        computation, so the reply may still come: it is then dropped on arrival. An in-process
        Grid does not compute it at all.
        """
        if job.message_id not in self.transport.inflight:
            return
        w = job.worker
        self.books.ended(w, "cancelled")
        self._if_idle(w)
        for obs in self.observers:
            obs.job_cancelled(job, self.clock.now)
        spent = self.source.cancel(job)
        if spent is not None:
            self.books.busy_done[w] += spent
            self.books.wasted[w] += spent

    def cancel_all(self) -> None:
        list(map(self.cancel, list(self.transport.inflight.values())))

    def _cancelled_reply(self, job: Job, rep: Message) -> None:
        """The reply of a cancelled job came (wall clock): its compute time is wasted work."""
        spent = self.source.cancelled_reply(job, rep)
        self.books.busy_done[job.worker] += spent
        self.books.wasted[job.worker] += spent

    def _if_idle(self, worker: int) -> None:
        if not self.books.in_flight[worker]:
            self.population.selector.idle(worker)

    def discard(self, job: Job) -> None:
        """Book a finished job whose result the strategy does not use (e.g. an obsolete round)."""
        self.books.unused(job.worker)
        self.books.wasted[job.worker] += self.source.work(job)

    def record_update(self, worker: int, stepsize: float) -> None:
        """Book one server update triggered by ``worker`` (k += 1)."""
        self.books.record_update(worker, stepsize)
        for obs in self.observers:
            obs.update_applied(worker, stepsize, self.books.version)

    # ------------------------------------------------------------------ completions
    def pop_joined(self) -> list[int]:
        return self.membership.pop_joined()

    # ------------------------------------------------------------------ one completion, step by step
    # (``Driver.update`` calls these in order: the plan of an update)
    def next_ended(self, budget: float = float("inf")) -> tuple[Completion, Message | None] | None:
        """Match: the next job to end, in the clock's order, as a completion with the reply that
        answers it (the transport matched it by ``reply_to_message_id`` and node), or a lost one
        (``rejected``, no reply). None once the next one would end after ``budget``, or when workers
        came back (``waiting``): the caller gives them jobs, then asks again."""
        nxt = self.source.next(budget)
        if nxt is None:
            return None
        job, reply, t, lost = nxt
        self.transport.done(job)
        comp = Completion(job=job, time=t, delay=self.books.version - job.version)
        if lost is not None or reply is None:
            comp.rejected = lost or "lost"
            comp.detail = _LOST_DETAIL.get(comp.rejected, "no reply")
            (log.debug if comp.rejected == "offline" else log.warning)("job %d (%s) lost: %s", job.job_id,
                                                                        self.membership.name(job.worker), comp.rejected)
            return comp, None
        return comp, reply

    def validate(self, comp: Completion, reply: Message) -> None:
        """Validate: the reply's arrays against the model's layout (keys, shapes, dtypes, finite
        values) and its metrics; the completion's update is then a direction g (a model reply's:
        the pseudo-gradient x_sent − y), or it is rejected with the reason (``update_of``)."""
        try:
            comp.update, comp.carried, comp.metrics, norm = update_of(
                reply, self.layout, self.reply, lambda: self.model_of(comp.job), arrayrecord_key=self.transport.keys[0],
                replicas=self.replicas)
            self._norm = (comp, norm)  # (measured with the finiteness test: the bounds take it)
        except RejectedReply as rej:
            self._reject(comp, rej)

    def apply_bounds(self, comp: Completion) -> None:
        """Bound: an accepted update passes the strategy's bounds (``fl_rescaled.bounds``: the outlier
        guard may reject it, the median clip and the clips scale it down)."""
        measured, self._norm = self._norm, None
        if comp.ok and self.bound is not None:
            try:
                comp.update = self.bound.apply(self.bound_state, comp.update, comp.worker, self.influence(comp.worker),
                                               norm=measured[1] if measured is not None and measured[0] is comp else None)
            except RejectedReply as rej:
                comp.update = None
                self._reject(comp, rej)

    def _reject(self, comp: Completion, rej: RejectedReply) -> None:
        """(A client's error code and text are kept bounded: ``Books.reason_key``, ``DETAIL_LIMIT``.)"""
        comp.rejected, comp.detail = self.books.reason_key(str(rej.reason)), str(rej.detail)[:DETAIL_LIMIT]
        log.warning("%s the reply to job %d (%s): %s: %s", "lost" if is_lost(comp.rejected) else "rejected",
                    comp.job.job_id, self.membership.name(comp.worker), comp.rejected,
                    failure_text(comp.rejected, comp.detail, 300))

    def book(self, comp: Completion) -> None:
        """Book: the job's outcome and compute time (``Books``, the one writer of outcomes), the
        worker's reputation (a client far above the others, or failing again and again, is set
        aside: ``reputation``), its slot idle; the observers are told."""
        job, w, t = comp.job, comp.worker, comp.time
        if comp.ok:
            self.books.ended(w, "applied")
            self.books.busy_done[w] += self.source.accepted(job, comp.metrics, t,
                                                            int(self.books.outcomes["applied"][w]))
            if self.bound is not None:
                suspect(self, w)
        else:
            self.books.busy_done[w] += self.source.failed(job, t)
            if comp.rejected in NODE_GONE:
                self.source.node_gone(job)
            outcome = outcome_of(comp.rejected)
            self.books.ended(w, outcome, comp.detail)
            if is_strike(outcome) and self.books.strikes[w] >= SET_ASIDE_AFTER and not self.membership.is_aside(w):
                strike_out(self, w, comp)
        self._if_idle(w)
        for obs in self.observers:
            obs.completed(comp)

    def largest_updates(self, k: int) -> list[tuple[int, float]]:
        """The ``k`` workers whose updates stood furthest above the others' (``Chain.largest``)."""
        return self.bound.largest(self.bound_state, k) if self.bound is not None else []

    # ------------------------------------------------------------------ reporting
    def summary(self, t: float) -> dict[str, Any]:
        """The books' row of an evaluation at time ``t``."""
        return self.books.summary(t, self.source.busy(self.books.busy_done, t))

    def books_totals(self) -> dict[str, Any]:
        return self.books.totals(self.clock.now)

    # ------------------------------------------------------------------ the run's state
    def state(self) -> ManagerState:
        """The manager's part of the run's state (a snapshot to write; nothing is copied)."""
        jobs = list(self.transport.inflight.values())
        models: dict[int, dict[str, np.ndarray]] = {}
        for job in jobs:
            if job.version not in models and job.model is not None:
                models[job.version] = {k: np.array(decode_array(a)) for k, a in job.model.items()}
        return ManagerState(books=self.books, roster=self.membership.roster,
                            active=[bool(a) for a in self.periods.active], next_job_id=self._next_job_id,
                            population=self.population.state(), jobs=jobs, models=models, bounds=self.bound_state,
                            **self.source.snapshot())

    def resume(self, state: ManagerState, concurrency: int | None, seed: int, weights: list[float] | None,
               selection: str = "uniform") -> list[int]:
        """Go on from ``state`` (read from a checkpoint, on this manager's Grid and clock); each part
        checks what it restores (ValueError, one line, before anything runs). The clock's source
        says what becomes of the jobs that were in flight: sent again as they were (virtual clock:
        the run goes on as if it had never stopped), or lost (wall clock: the nodes may have
        answered a server that no longer exists; they are booked ``lost.resumed``). Returns the
        workers that need jobs now: none, or (wall clock) every worker online."""
        books, n = state.books, state.books.n
        if len(state.roster.node_ids) != n or len(state.active) != n:
            raise ValueError("the checkpoint's books and roster disagree on the number of workers")
        if state.active != state.roster.online.tolist():  # (counted in the τ statistics: online, not aside)
            raise ValueError("the workers counted as active in its τ statistics are not the ones online")
        if self.bound is not None:
            self.bound.check(state.bounds)
        elif state.bounds:
            raise ValueError("the checkpoint has update bounds and this run has none")
        records = {v: self.layout.record_of(arrays, f"the checkpoint's model of version {v}")
                   for v, arrays in state.models.items()}
        check_jobs(state.jobs, books, state.next_job_id, set(records))
        self.books, self.bound_state = books, state.bounds
        self.membership.use(state.roster)
        self.source.tables(n, weights)
        self.populate(concurrency, seed, weights, selection)
        self.population.restore(state.population, books.in_flight == 0)
        self._next_job_id = state.next_job_id
        for job in state.jobs:
            job.model = records[job.version]
        lost, needs_jobs = self.source.restore(state, self.population)
        for worker, active in enumerate(state.active):
            self._set_active(worker, active)  # (a worker set aside stays aside)
        for job in lost:  # (not pushed again)
            self.books.ended(job.worker, "lost.resumed", "the server restarted")
            self._if_idle(job.worker)
        return needs_jobs
