"""The asynchronous client manager: what a strategy asks for and hands back, one job at a time.

A strategy asks the manager to ``submit`` a job (a model and its version) to a worker and for the
``next_completion``. The manager composes four parts, one idea each:

- ``VirtualScheduler`` (virtual clock): each job's start and finish time, the next to finish;
- ``Transport``: jobs out as Flower Messages, replies in, matched by ``reply_to_message_id``;
- ``Membership``: which node is which worker, nodes that leave and come back (wall clock);
- ``Books``: per-worker counters and times, rejections by reason, summaries.

Here it validates replies against the model layout (``reply="model"``: turns the trained model
into the pseudo-gradient x_sent − y), estimates τ online on the wall clock (a ``TauTable`` the
stepsize rules read), and tells its ``observers`` (``ManagerObserver``) what happens.

Virtual clock: completions are handed over in order of simulated finishing time (ties: ascending
worker index, then job id), whatever order the transport returns replies in. Wall clock: in
arrival order.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from fl_rescaled.clock import VirtualClock, WallClock
from fl_rescaled.errors import RejectedReply
from fl_rescaled.layout import ModelLayout, all_finite
from fl_rescaled.messages import JOB_TYPE, job_content, parse_reply
from fl_rescaled.stepsizes import TauTable

from .books import LOST, Books, WorkerBook
from .jobs import NODE_GONE, Completion, Job, zero_nonfinite_replicas
from .membership import Membership
from .observers import ManagerObserver
from .scheduler import VirtualScheduler
from .transport import Transport

log = logging.getLogger("flwr.fl_rescaled")


class AsyncClientManager:
    """Runs jobs on Flower nodes for an asynchronous strategy.

    ``layout``: the model's ``ModelLayout``; jobs carry the model in it and replies are checked
    against it. ``reply``: what a reply's arrays are, ``"gradient"`` (g itself) or ``"model"`` (the
    trained model y). Either way a completion's ``update`` is a direction g for x ← x − γ g.
    """

    def __init__(
        self,
        grid: Grid,
        clock: VirtualClock | WallClock,
        *,
        layout: ModelLayout,
        reply: str = "gradient",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        train_config: dict[str, Any] | None = None,
        ttl: float = 3600.0,
        poll_interval: float = 0.002,
        tau_smoothing: float = 0.2,
        tau_estimator: str = "interval",
        worker_config: list[dict[str, Any]] | None = None,
        node_refresh: float = 2.0,
        observers: list[ManagerObserver] | None = None,
    ) -> None:
        if reply not in ("gradient", "model"):
            raise ValueError(f"reply must be 'gradient' or 'model', got {reply!r}")
        if tau_estimator not in ("interval", "compute"):
            raise ValueError("tau_estimator must be 'interval' or 'compute'")
        self.grid = grid
        self.clock = clock
        self.layout = layout
        self.reply = reply
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.train_config = dict(train_config or {})
        self.ttl = float(ttl)
        self.tau_smoothing = tau_smoothing
        self.tau_estimator = tau_estimator
        self.worker_config = worker_config  # extra per-worker job config (e.g. emulated τ_i)
        self.observers: list[ManagerObserver] = list(observers or [])
        self.replicas = 1  # batched runs: the model is this many replicas end to end
        self.ledger = Books([])
        self.books: list[WorkerBook] = self.ledger.workers
        self.taus = TauTable(0)  # (sized by connect)
        self.transport = Transport(grid, self.ledger, ttl=ttl, poll_interval=poll_interval,
                                   time_unit=getattr(clock, "time_unit", 1.0))
        self.membership = Membership(grid, self.transport, ttl=ttl, node_refresh=node_refresh)
        self.membership.on_online = self.worker_online
        self.scheduler = VirtualScheduler(clock) if clock.virtual else None
        self.inflight = self.transport.inflight
        self._next_job_id = 0
        self._encoded: tuple[int, ArrayRecord] | None = None  # (version, encoded model)

    def worker_online(self, worker: int, online: bool) -> None:
        """A worker left or came back (the membership tells): it counts in the τ statistics while online."""
        self.taus.set_active(worker, online)

    # ------------------------------------------------------------------ checkpoints
    def __getstate__(self) -> dict:  # (a checkpoint: no Grid, no observers; jobs keep their models)
        return {**self.__dict__, "grid": None, "observers": []}

    # ------------------------------------------------------------------ the run's numbers
    @property
    def version(self) -> int:
        return self.ledger.version

    @property
    def stepsize_sum(self) -> float:
        return self.ledger.stepsize_sum

    @stepsize_sum.setter
    def stepsize_sum(self, value: float) -> None:
        self.ledger.stepsize_sum = value

    @property
    def rejections(self):
        return self.ledger.rejections

    @property
    def first_rejection(self) -> tuple[str, str] | None:
        return self.ledger.first_rejection

    @property
    def accepted(self) -> int:
        return self.ledger.accepted

    @property
    def num_workers(self) -> int:
        return len(self.books)

    @property
    def partition_query(self) -> bool:
        return self.membership.partition_query

    @property
    def joined(self) -> list[int]:
        return self.membership.joined

    # ------------------------------------------------------------------ workers
    def connect(self, num_workers: int | None = None, timeout: float = 120.0, *,
                partition_query: bool = False, weights: list[float] | None = None) -> list[int]:
        """Wait for the nodes and number them as workers; return the node ids in worker order.

        ``partition_query``: number the workers by the partition each node says it holds (a node
        that does not answer fails the run with a clear message); else in node-id order.
        ``weights``: target weights per worker, for the stepsize rules (``TauTable``).
        """
        order = self.membership.connect(num_workers, timeout, partition_query)
        self.ledger.workers[:] = [WorkerBook(node_id=n) for n in order]
        self.membership.books = self.ledger
        if self.clock.virtual:
            if self.clock.delays.num_workers < len(order):
                raise ValueError(f"the clock knows {self.clock.delays.num_workers} workers, the grid has {len(order)}")
            self.taus = TauTable(len(order), self.clock.delays.taus[: len(order)], weights)
        else:
            self.taus = TauTable(len(order), None, weights)
        return order

    def tau_estimates(self) -> list[float]:
        """Mean compute time per worker: exact in simulation, estimated online on the wall clock."""
        return list(self.taus.taus)

    def online_workers(self) -> list[int]:
        return self.membership.online_workers()

    def pop_joined(self) -> list[int]:
        return self.membership.pop_joined()

    # ------------------------------------------------------------------ jobs
    def submit(self, worker: int, model: np.ndarray, version: int, config: dict | None = None,
               carried: dict[str, np.ndarray] | None = None) -> Job:
        """Send ``worker`` a job on ``model`` (the flat float vector of server version ``version``,
        with the non-float arrays ``carried``). A model of the version last encoded is not
        serialised again. If the worker is still busy the job queues behind its current ones."""
        encoded = self._encoded
        if encoded is None or encoded[0] != version:
            encoded = self._encoded = (version, self.layout.encode(model, carried or {}))
        return self._push(worker, version, encoded[1], config)

    def resend(self, worker: int, config: dict | None = None) -> Job:
        """Give ``worker`` another job on the model it was last sent (same version, not re-encoded)."""
        book = self.books[worker]
        if book.last_model is None:
            raise RuntimeError(f"worker {worker} has not been sent a model yet")
        return self._push(worker, book.last_version, book.last_model, config)

    def model_of(self, job: Job) -> np.ndarray:
        """The flat model a job was computed on (read-only when the model is one float array)."""
        assert job.model is not None
        return self.layout.flatten(job.model)[0]

    def _push(self, worker: int, version: int, model: ArrayRecord, config: dict | None) -> Job:
        book = self.books[worker]
        seq = book.jobs_sent
        job = Job(self._next_job_id, worker, version, seq, self.clock.now, model=model, node_id=book.node_id)
        self._next_job_id += 1
        book.jobs_sent = seq + 1
        book.last_version, book.last_model = version, model
        if self.scheduler is not None:
            self.scheduler.schedule(job, book)
        tag = {"job-id": job.job_id, "worker": worker, "version": version, "job-seq": seq, "server-round": version + 1}
        if self.worker_config is not None:
            tag.update(self.worker_config[worker])
        cfg = job.config = {**self.train_config, **config, **tag} if config else {**self.train_config, **tag}
        msg = Message(job_content(model, cfg, self.arrayrecord_key, self.configrecord_key), book.node_id, JOB_TYPE,
                      ttl=self.ttl, group_id=str(version))
        self.transport.push(msg, job)
        if self.scheduler is not None:
            self.scheduler.track(job)
        for obs in self.observers:
            obs.job_sent(job)
        return job

    def cancel(self, job: Job) -> None:
        """Stop a job in flight; its work so far is booked as discarded.

        On the virtual clock the worker is free at once. A transport cannot stop a remote
        computation, so the reply may still come: it is then dropped on arrival. An in-process
        Grid with ``discard_messages`` does not compute it at all.
        """
        if job.message_id not in self.inflight:
            return
        book = self.books[job.worker]
        transport = self.transport
        self.ledger.finished(job.worker, "cancelled")
        if self.scheduler is not None:
            elapsed = self.scheduler.cancel(job, book)
            book.busy_done += elapsed
            if elapsed > 0:
                book.discarded += 1
                book.wasted += elapsed
            transport.done(job)
            discard = getattr(self.grid, "discard_messages", None)
            if discard is not None:
                discard([job.message_id])
            return
        book.discarded += 1
        transport.inflight.pop(job.message_id, None)
        book.pending.pop(job.message_id, None)
        rep = transport.arrived.pop(job.message_id, None)
        if rep is None:
            transport.cancelled[job.message_id] = job
        else:  # its reply is already buffered: drop it now, as on a later arrival
            transport.drop_cancelled(job, rep)

    def record_update(self, worker: int, stepsize: float) -> None:
        """Book one applied server update triggered by ``worker`` (k += 1)."""
        self.ledger.record_update(worker, stepsize)
        for obs in self.observers:
            obs.update_applied(worker, stepsize, self.ledger.version)

    def discard(self, job: Job) -> None:
        """Book a finished job whose result the strategy does not use (e.g. an obsolete round)."""
        book = self.books[job.worker]
        book.discarded += 1
        self.ledger.unused(job.worker)
        if self.clock.virtual:
            book.wasted += job.finish_time - job.start_time

    def pending_jobs(self, worker: int | None = None) -> list[Job]:
        if worker is None:
            return list(self.inflight.values())
        return list(self.books[worker].pending.values())

    # ------------------------------------------------------------------ completions
    def next_completion(self, budget: float = math.inf) -> Completion | None:
        """The next finished job, or None once the next one would finish after ``budget``.

        Wall clock: also returns None early when workers (re)joined (see ``joined``) so the
        strategy can give them jobs; the caller then asks again.
        """
        transport = self.transport
        if self.scheduler is not None:
            job = self.scheduler.next_job(self.inflight)
            if job is None or job.finish_time > budget:
                return None
            t0 = time.perf_counter()
            reply = transport.await_reply(job)
            for obs in self.observers:
                obs.reply_awaited(job, time.perf_counter() - t0)
            self.clock.advance(job.finish_time)
            return self._complete(job, reply, job.finish_time)
        membership = self.membership
        while True:
            if self.clock.now > budget:
                return None
            if membership.due():
                membership.refresh()
            if membership.joined:
                return None
            mid = transport.next_arrival() if self.inflight else None
            if mid is None:
                expired = transport.expired_job()
                if expired is not None:
                    return self._complete(expired, None, self.clock.now, lost="ttl-expired")
                time.sleep(transport.poll_interval)
                continue
            return self._complete(self.inflight[mid], transport.arrived.pop(mid), self.clock.now)

    def _complete(self, job: Job, reply: Message | None, t: float, lost: str | None = None) -> Completion:
        self.transport.done(job)
        book = self.books[job.worker]
        book.jobs_done += 1
        comp = Completion(job=job, time=t, delay=self.ledger.version - job.version)
        if self.clock.virtual:
            book.busy_done += job.finish_time - job.start_time
        if lost is not None or reply is None:
            comp.rejected = lost or "lost"
            comp.detail = "no reply within the job's TTL" if comp.rejected == "ttl-expired" else "no reply"
            log.warning("job %d (worker %d) lost: %s", job.job_id, job.worker, comp.rejected)
        else:
            try:
                self._read_reply(comp, reply)
                self.ledger.accepted += 1
                self.ledger.finished(job.worker, "applied")
            except RejectedReply as rej:
                comp.rejected, comp.detail = rej.reason, rej.detail
                log.warning("rejected the reply to job %d (worker %d): %s", job.job_id, job.worker, rej)
        if comp.rejected is not None:
            # A job that never came back, or came back as a transport/ClientApp error, is lost.
            if reply is None or comp.rejected.startswith("error-code"):
                book.lost += 1
            # Its node is gone for now (until it reappears), unless the worker has already moved
            # to a new node.
            if comp.rejected in NODE_GONE and not self.clock.virtual and job.node_id == book.node_id:
                self.membership.set_online(job.worker, False)
            book.rejected += 1
            self.ledger.record_rejection(comp.rejected, comp.detail)
            self.ledger.finished(job.worker, f"{'lost' if comp.rejected in LOST else 'rejected'}.{comp.rejected}")
        elif not self.clock.virtual:
            self._estimate_tau(comp, book)
        for obs in self.observers:
            obs.completed(comp)
        return comp

    def _estimate_tau(self, comp: Completion, book: WorkerBook) -> None:
        """Wall clock: update worker i's τ estimate (an exponential moving average, initialised
        from its first job) from the time between its deliveries or its reported compute time.

        A client's report is never trusted beyond what the server saw: the compute time it claims is
        clamped to the time from the job's dispatch to its reply, so a client that claims a huge τ
        (to raise its own step, or to become τ_max and shrink everybody else's) gets at most the
        time it really took."""
        now = time.monotonic()
        job = comp.job
        unit = self.clock.time_unit
        observed = max(now - job.pushed_at, 1e-9)
        reported = comp.metrics.get("compute-time")
        valid = isinstance(reported, (int, float)) and not isinstance(reported, bool) and math.isfinite(reported)
        compute = min(float(reported), observed) if valid and reported > 0 else observed
        compute /= unit
        book.busy_done += compute
        if self.tau_estimator == "compute":
            measured = compute
        else:  # time between this worker's deliveries (its first: since its first job was sent)
            since = book.last_delivery if not math.isnan(book.last_delivery) else job.pushed_at
            measured = max(now - since, 1e-9) / unit
        book.last_delivery = now
        old = self.taus.taus[job.worker]
        a = self.tau_smoothing
        self.taus.update(job.worker, measured if math.isnan(old) else (1 - a) * old + a * measured)

    def _read_reply(self, comp: Completion, reply: Message) -> None:
        """Validate a reply and fill the completion's update (a direction g), metrics and carried
        arrays; raises ``RejectedReply``."""
        batched = self.replicas > 1
        flat, carried, metrics = parse_reply(reply, self.layout, arrayrecord_key=self.arrayrecord_key,
                                             carried_required=self.reply == "model", check_finite=not batched)
        if self.reply == "model":
            with np.errstate(over="ignore", invalid="ignore"):
                flat = np.subtract(self.model_of(comp.job), flat)
            if not batched and not all_finite(flat):
                raise RejectedReply("non-finite", "the returned model minus the model sent overflows")
        if batched:
            flat, bad = zero_nonfinite_replicas(flat, self.replicas)
            if bad:
                metrics["nonfinite-replicas"] = bad
        comp.update, comp.carried, comp.metrics = flat, carried, metrics

    # ------------------------------------------------------------------ reporting
    def busy_time(self, worker: int, t: float | None = None) -> float:
        """Time ``worker`` spent computing up to time ``t`` (default: now)."""
        return self.ledger.busy_time(worker, self.clock.now if t is None else t, self.clock.virtual)

    def idle_share(self, worker: int, t: float | None = None) -> float:
        return self.ledger.idle_share(worker, self.clock.now if t is None else t, self.clock.virtual)

    def summary(self, t: float | None = None) -> dict[str, Any]:
        return self.ledger.summary(self.clock.now if t is None else t, self.clock.virtual)

    def books_summary(self) -> dict[str, int | float]:
        return self.ledger.totals(len(self.inflight), self.clock.now)
