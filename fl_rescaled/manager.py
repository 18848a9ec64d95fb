"""The asynchronous client manager: jobs in flight, completions in clock order, per-worker books.

The manager is the only piece that talks to the Grid. A strategy asks it to ``submit`` a job
(a model and its version) to a worker and to hand over the ``next_completion``; the manager tags
every job (job id, worker, version, per-worker sequence number), draws its virtual compute time,
pushes one Flower ``Message`` per job, pulls the replies, validates them and keeps the books:
updates, cumulative stepsize, busy/idle time, rejected, lost and discarded jobs.

Virtual clock: completions are handed over in order of simulated finishing time (ties: ascending
worker index, then job id), whatever order the transport returns replies in. Wall clock: in
arrival order, with each worker's mean compute time estimated online from measured job times.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from .clock import VirtualClock, WallClock
from .errors import RejectedReply, client_error_text
from .layout import ModelLayout
from .messages import JOB_TYPE, hello_message, job_content, parse_hello, parse_reply

#: Rejection reasons that mean the node itself is gone (not just this job): Flower's
#: MESSAGE_UNAVAILABLE (expired in transit), NODE_UNAVAILABLE, and our own TTL expiry.
NODE_GONE = ("error-code-3", "error-code-5", "ttl-expired")

log = logging.getLogger("flwr.fl_rescaled")

#: Virtual-clock order of completions: finishing time, then worker index, then job id.
_COMPLETION_ORDER = attrgetter("finish_time", "worker", "job_id")


@dataclass
class Job:
    job_id: int
    worker: int
    version: int
    seq: int  # this worker's job number (0, 1, 2, ...): seeds the client's randomness
    dispatch_time: float
    start_time: float = math.nan
    finish_time: float = math.nan  # virtual clock only
    message_id: str = ""
    pushed_at: float = 0.0  # wall-clock seconds (time.monotonic)
    model: ArrayRecord | None = None  # the encoded model this job carries (shared, never copied)
    node_id: int = 0  # the node it was sent to (a worker's node id changes if its SuperNode restarts)


@dataclass
class Completion:
    job: Job
    time: float
    delay: int  # δ = k − v: server updates applied since the job's model was sent
    update: np.ndarray | None = None  # a direction g (flat): the server steps x ← x − γ g
    metrics: dict[str, Any] = field(default_factory=dict)
    carried: dict[str, np.ndarray] = field(default_factory=dict)  # the reply's non-float arrays
    rejected: str | None = None  # reason when the reply must not touch the model
    detail: str = ""  # what was wrong with it, and what was expected

    @property
    def worker(self) -> int:
        return self.job.worker

    @property
    def ok(self) -> bool:
        return self.rejected is None


@dataclass
class WorkerBook:
    node_id: int
    updates: int = 0
    stepsize_sum: float = 0.0
    jobs_sent: int = 0
    jobs_done: int = 0
    rejected: int = 0
    lost: int = 0
    discarded: int = 0  # jobs whose (partial) work was thrown away
    wasted: float = 0.0  # compute time of those jobs
    busy_done: float = 0.0  # compute time of finished or cancelled jobs
    free_at: float = 0.0  # virtual time at which the worker's queue empties
    tau_estimate: float = math.nan  # online mean compute time (wall clock)
    online: bool = True  # wall clock: False after its node was reported gone, until it reappears
    last_delivery: float = math.nan  # wall clock: time.monotonic() of the last accepted reply
    last_version: int = -1  # the model version this worker was last sent ...
    last_model: ArrayRecord | None = None  # ... and that model, encoded


def zero_nonfinite_replicas(flat: np.ndarray, replicas: int) -> tuple[np.ndarray, list[int]]:
    """A batched reply (R replicas' vectors end to end) with the non-finite replicas' rows zeroed
    (in a copy) and their indices, instead of a rejection for every replica (they are frozen)."""
    if np.isfinite(np.dot(flat, flat)) or np.isfinite(flat).all():
        return flat, []
    rows = flat.reshape(replicas, -1).copy()
    bad = ~np.isfinite(rows).all(axis=1)
    rows[bad] = 0.0
    return rows.reshape(-1), [int(r) for r in np.flatnonzero(bad)]


class AsyncClientManager:
    """Runs jobs on Flower nodes for an asynchronous strategy.

    ``layout``: the model's ``ModelLayout``; jobs carry the model in it and replies are checked
    against it. ``reply``: what a reply's arrays are, ``"gradient"`` (g itself) or ``"model"``
    (the trained model y; the manager hands the strategy the pseudo-gradient x_sent − y, from the
    model the job carried). Either way a completion's ``update`` is a direction g for x ← x − γ g.
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
    ) -> None:
        if reply not in ("gradient", "model"):
            raise ValueError(f"reply must be 'gradient' or 'model', got {reply!r}")
        self.grid = grid
        self.clock = clock
        self.layout = layout
        self.reply = reply
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.train_config = dict(train_config or {})
        self.ttl = float(ttl)
        self.poll_interval = poll_interval
        self.tau_smoothing = tau_smoothing
        if tau_estimator not in ("interval", "compute"):
            raise ValueError("tau_estimator must be 'interval' or 'compute'")
        self.tau_estimator = tau_estimator
        self.worker_config = worker_config  # extra per-worker job config (e.g. emulated τ_i)
        self.node_refresh = node_refresh
        self.partition_query = False  # set by connect: nodes answered the partition query
        self._next_refresh = 0.0
        self._hello_pending: dict[str, int] = {}  # hello message id -> node id (nodes that appeared)
        self.joined: list[int] = []  # workers that (re)appeared and wait for a job
        self._ignored_nodes: set[int] = set()  # nodes that are not workers of this run
        self.books: list[WorkerBook] = []
        self.worker_of_node: dict[int, int] = {}
        self.version = 0  # k: server updates applied so far
        self.stepsize_sum = 0.0
        self.replicas = 1  # batched runs: the model is this many replicas end to end (see _complete)
        self.inflight: dict[str, Job] = {}
        self.rejections: Counter[str] = Counter()
        self.first_rejection: tuple[str, str] | None = None  # (reason, detail) of the first one
        self.accepted = 0  # replies that passed validation
        self._next_job_id = 0
        self._arrived: dict[str, Message] = {}
        self._arrival_order: deque[str] = deque()
        self._finished_ids: set[str] = set()
        self._encoded: tuple[int, ArrayRecord] | None = None  # (version, encoded model)
        self._cancelled: dict[str, Job] = {}  # cancelled jobs whose replies may still arrive

    # ------------------------------------------------------------------ workers
    @property
    def num_workers(self) -> int:
        return len(self.books)

    def connect(self, num_workers: int | None = None, timeout: float = 120.0, *,
                partition_query: bool = False) -> list[int]:
        """Wait for the nodes and number them as workers; return the node ids in worker order.

        ``partition_query``: ask every node which partition it holds (``query.hello``, answered by
        a ClientApp that called ``add_partition_query``) and number the workers by partition id;
        a node that does not answer fails the run with a clear message. Without it the workers
        are the nodes in ascending node-id order.
        """
        deadline = time.monotonic() + timeout
        nodes: list[int] = []
        while True:
            nodes = sorted(int(n) for n in self.grid.get_node_ids())
            if nodes and (num_workers is None or len(nodes) >= num_workers):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(nodes)} of {num_workers} nodes connected within {timeout:g} s")
            time.sleep(0.1)
        order = self._order_by_partition(nodes, deadline) if partition_query else nodes
        self.partition_query = partition_query
        if num_workers is not None:
            order = order[:num_workers]
        self.books = [WorkerBook(node_id=n) for n in order]
        self.worker_of_node = {n: i for i, n in enumerate(order)}
        self._ignored_nodes = set(nodes) - set(order)
        return order

    def _order_by_partition(self, nodes: list[int], deadline: float) -> list[int]:
        ids = list(self.grid.push_messages([hello_message(n, max(1.0, deadline - time.monotonic())) for n in nodes]))
        node_of = dict(zip(ids, nodes))
        pending = set(ids)
        partition: dict[int, int] = {}
        failed: dict[int, str] = {}
        while pending and time.monotonic() < deadline:
            got = False
            for rep in self.grid.pull_messages(list(pending)):
                got = True
                mid = rep.metadata.reply_to_message_id
                pending.discard(mid)
                pid = parse_hello(rep)
                if pid is None:
                    failed[node_of.get(mid, rep.metadata.src_node_id)] = (
                        str(rep.error.reason) if rep.has_error() else "no partition-id in the answer")
                else:
                    partition[node_of.get(mid, rep.metadata.src_node_id)] = pid
            if not got:
                time.sleep(0.05)
        if pending or failed:
            why = (f"{len(pending)} node(s) did not answer within the timeout" if pending
                   else f"node {next(iter(failed))} answered: {client_error_text(next(iter(failed.values())))}")
            raise RuntimeError(
                "this run numbers its workers by partition (per-partition taus, weights or worker "
                f"config), but the partition query failed: {why}. Add the query to your ClientApp with "
                "`fl_rescaled.add_partition_query(app)`, or give the settings in node-id order without it.")
        pids = [partition[n] for n in nodes]
        if sorted(pids) != list(range(len(nodes))):
            raise RuntimeError(f"the nodes hold partitions {sorted(pids)}; expected 0..{len(nodes) - 1} once each")
        return sorted(nodes, key=lambda n: partition[n])

    def tau_estimates(self) -> list[float]:
        """Mean compute time per worker: exact in simulation, estimated online on the wall clock."""
        if self.clock.virtual:
            return list(self.clock.delays.taus[: self.num_workers])
        return [b.tau_estimate for b in self.books]

    # ------------------------------------------------------------------ jobs
    def submit(self, worker: int, model: np.ndarray, version: int, config: dict | None = None,
               carried: dict[str, np.ndarray] | None = None) -> Job:
        """Send ``worker`` a job on ``model`` (the flat float vector of server version ``version``,
        with the non-float arrays ``carried``).

        A model of the version last encoded is not serialised again. If the worker is still busy
        the job queues behind its current ones (first in, first out).
        """
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
        clock = self.clock
        now = clock.now
        seq = book.jobs_sent
        job = Job(self._next_job_id, worker, version, seq, now, model=model, node_id=book.node_id)
        self._next_job_id += 1
        book.jobs_sent = seq + 1
        book.last_version, book.last_model = version, model
        if clock.virtual:
            job.start_time = start = max(now, book.free_at)
            job.finish_time = book.free_at = start + clock.job_duration(worker)
        tag = {"job-id": job.job_id, "worker": worker, "version": version, "job-seq": seq, "server-round": version + 1}
        if self.worker_config is not None:
            tag.update(self.worker_config[worker])
        cfg = {**self.train_config, **config, **tag} if config else {**self.train_config, **tag}
        msg = Message(job_content(model, cfg, self.arrayrecord_key, self.configrecord_key), book.node_id, JOB_TYPE,
                      ttl=self.ttl, group_id=str(version))
        (mid,) = self.grid.push_messages([msg])
        job.message_id = mid
        job.pushed_at = time.monotonic()
        self.inflight[mid] = job
        return job

    def cancel(self, job: Job) -> None:
        """Stop a job in flight; its work so far is booked as discarded.

        On the virtual clock the worker is free at once. A transport cannot stop a remote
        computation, so the reply may still come: it is then dropped on arrival. An in-process
        Grid with ``discard_messages`` does not compute it at all.
        """
        if self.inflight.pop(job.message_id, None) is None:
            return
        book = self.books[job.worker]
        if self.clock.virtual:
            now = self.clock.now
            elapsed = max(0.0, min(now, job.finish_time) - job.start_time)
            book.busy_done += elapsed
            if elapsed > 0:
                book.discarded += 1
                book.wasted += elapsed
            if job.finish_time >= book.free_at:  # the worker's last job: it is free from now on
                book.free_at = min(book.free_at, max(now, job.start_time))
            self._finished_ids.add(job.message_id)
            discard = getattr(self.grid, "discard_messages", None)
            if discard is not None:
                discard([job.message_id])
        else:
            book.discarded += 1
            rep = self._arrived.pop(job.message_id, None)
            if rep is None:
                self._cancelled[job.message_id] = job
            else:  # its reply is already buffered: drop it now, as on a later arrival
                self._drop_cancelled(job, rep)

    def record_update(self, worker: int, stepsize: float) -> None:
        """Book one applied server update triggered by ``worker`` (k += 1)."""
        self.version += 1
        self.stepsize_sum += stepsize
        book = self.books[worker]
        book.updates += 1
        book.stepsize_sum += stepsize

    def discard(self, job: Job) -> None:
        """Book a finished job whose result the strategy does not use (e.g. an obsolete round)."""
        book = self.books[job.worker]
        book.discarded += 1
        if self.clock.virtual:
            book.wasted += job.finish_time - job.start_time

    def pending_jobs(self, worker: int | None = None) -> list[Job]:
        jobs = self.inflight.values()
        return [j for j in jobs if worker is None or j.worker == worker]

    # ------------------------------------------------------------------ completions
    def next_completion(self, budget: float = math.inf) -> Completion | None:
        """The next finished job, or None once the next one would finish after ``budget``.

        Wall clock: also returns None early when workers (re)joined (see ``joined``) so the
        strategy can give them jobs; the caller then asks again.
        """
        if self.clock.virtual:
            if not self.inflight:
                return None
            job = min(self.inflight.values(), key=_COMPLETION_ORDER)
            if job.finish_time > budget:
                return None
            reply = self._await(job)
            self.clock.advance(job.finish_time)
            return self._complete(job, reply, job.finish_time)
        while True:
            if self.clock.now > budget:
                return None
            if time.monotonic() >= self._next_refresh:
                self._refresh_nodes()
            if self.joined:
                return None
            mid = self._next_arrival() if self.inflight else None
            if mid is None:
                expired = self._expired_job()
                if expired is not None:
                    return self._complete(expired, None, self.clock.now, lost="ttl-expired")
                time.sleep(self.poll_interval)
                continue
            job = self.inflight[mid]
            return self._complete(job, self._arrived.pop(mid), self.clock.now)

    def _complete(self, job: Job, reply: Message | None, t: float, lost: str | None = None) -> Completion:
        del self.inflight[job.message_id]
        self._finished_ids.add(job.message_id)
        book = self.books[job.worker]
        book.jobs_done += 1
        delay = self.version - job.version
        comp = Completion(job=job, time=t, delay=delay)
        if self.clock.virtual:
            book.busy_done += job.finish_time - job.start_time
        if lost is not None or reply is None:
            comp.rejected = lost or "lost"
            comp.detail = "no reply within the job's TTL" if comp.rejected == "ttl-expired" else "no reply"
            log.warning("job %d (worker %d) lost: %s", job.job_id, job.worker, comp.rejected)
        else:
            try:
                self._read_reply(comp, reply)
                self.accepted += 1
            except RejectedReply as rej:
                comp.rejected, comp.detail = rej.reason, rej.detail
                if self.first_rejection is None:
                    self.first_rejection = (rej.reason, rej.detail)
                log.warning("rejected the reply to job %d (worker %d): %s", job.job_id, job.worker, rej)
        if comp.rejected is not None:
            # A job that never came back, or came back as a transport/ClientApp error, is lost.
            if reply is None or comp.rejected.startswith("error-code"):
                book.lost += 1
            # Its node is gone for now (until it answers a hello again), unless the worker has
            # already moved to a new node.
            if comp.rejected in NODE_GONE and not self.clock.virtual and job.node_id == book.node_id:
                book.online = False
            book.rejected += 1
            self.rejections[comp.rejected] += 1
        elif not self.clock.virtual:
            now = time.monotonic()
            reported = comp.metrics.get("compute-time")
            compute = float(reported) if reported is not None and reported > 0 else now - job.pushed_at
            compute /= self.clock.time_unit
            book.busy_done += compute
            if self.tau_estimator == "compute":
                measured = compute
            else:  # time between this worker's deliveries (its first: since its first job was sent)
                since = book.last_delivery if not math.isnan(book.last_delivery) else job.pushed_at
                measured = max(now - since, 1e-9) / self.clock.time_unit
            book.last_delivery = now
            if math.isnan(book.tau_estimate):
                book.tau_estimate = measured
            else:
                a = self.tau_smoothing
                book.tau_estimate = (1 - a) * book.tau_estimate + a * measured
        return comp

    def _read_reply(self, comp: Completion, reply: Message) -> None:
        """Validate a reply and fill the completion's update (a direction g), metrics and carried
        arrays; raises ``RejectedReply``."""
        layout = self.layout
        batched = self.replicas > 1
        flat, carried, metrics = parse_reply(reply, layout, arrayrecord_key=self.arrayrecord_key,
                                             carried_required=self.reply == "model", check_finite=not batched)
        if self.reply == "model":
            flat = np.subtract(self.model_of(comp.job), flat)
        if batched:
            flat, bad = zero_nonfinite_replicas(flat, self.replicas)
            if bad:
                metrics["nonfinite-replicas"] = bad
        comp.update, comp.carried, comp.metrics = flat, carried, metrics

    def _accept(self, replies: list[Message]) -> None:
        """Buffer pulled replies; reject those that answer no job in flight."""
        for rep in replies:
            mid = rep.metadata.reply_to_message_id
            if mid in self._hello_pending:
                self._on_hello(self._hello_pending.pop(mid), rep)
                continue
            if mid in self._cancelled:  # a cancelled job finished anyway: drop it
                self._drop_cancelled(self._cancelled.pop(mid), rep)
                continue
            if mid in self.inflight and mid not in self._arrived:
                self._arrived[mid] = rep
                self._arrival_order.append(mid)
                continue
            reason = "duplicate" if (mid in self._finished_ids or mid in self._arrived) else "unknown-job"
            self.rejections[reason] += 1
            log.warning("rejected a reply to message %r: %s", mid, reason)

    def _drop_cancelled(self, job: Job, rep: Message) -> None:
        """The reply of a cancelled job (wall clock): unused; its compute time is wasted work."""
        self._finished_ids.add(job.message_id)
        if rep.has_content() and "metrics" in rep.content:
            spent = float(rep.content["metrics"].get("compute-time", 0.0)) / self.clock.time_unit
            self.books[job.worker].wasted += spent
            self.books[job.worker].busy_done += spent

    def _await(self, job: Job) -> Message | None:
        """Block until the reply to ``job`` has arrived (virtual clock)."""
        mid = job.message_id
        deadline = job.pushed_at + self.ttl
        while mid not in self._arrived:
            self._accept(list(self.grid.pull_messages([mid])))
            if mid in self._arrived:
                break
            if time.monotonic() > deadline:
                return None
            time.sleep(self.poll_interval)
        return self._arrived.pop(mid)

    def _next_arrival(self) -> str | None:
        """The oldest buffered reply (wall clock), pulling new ones only when none is buffered."""
        mid = self._pop_arrival()
        if mid is None:
            self._accept(list(self.grid.pull_messages([*self.inflight, *self._hello_pending])))
            mid = self._pop_arrival()
        return mid

    def _pop_arrival(self) -> str | None:
        while self._arrival_order:
            mid = self._arrival_order.popleft()
            if mid in self._arrived:
                return mid
        return None

    def _expired_job(self) -> Job | None:
        now = time.monotonic()
        for job in self.inflight.values():
            if now - job.pushed_at > self.ttl:
                return job
        return None

    # ------------------------------------------------------------------ membership (wall clock)
    def online_workers(self) -> list[int]:
        return [i for i, b in enumerate(self.books) if b.online]

    def _refresh_nodes(self) -> None:
        """Look for nodes that appeared (a new or restarted SuperNode) and ask who they are."""
        self._next_refresh = time.monotonic() + self.node_refresh
        try:
            current = {int(n) for n in self.grid.get_node_ids()}
        except Exception as exc:  # noqa: BLE001 - a transient transport error: try later
            log.warning("could not list nodes: %s", exc)
            return
        for i, book in enumerate(self.books):
            if book.online and book.node_id not in current and not self.pending_jobs(i):
                book.online = False
                log.warning("worker %d (node %d) left", i, book.node_id)
            elif not book.online and book.node_id in current:
                if not self.partition_query:  # (no query to probe it with) listed again: back
                    self._rejoin(i, book.node_id)
                # Listed is not alive: a SIGKILLed node stays listed until its heartbeat times out
                # (~60 s). Probe it; _on_hello marks it back when it answers.
                elif book.node_id not in self._hello_pending.values():
                    self._probe([book.node_id])
        known = set(self.worker_of_node) | set(self._hello_pending.values()) | self._ignored_nodes
        new = sorted(current - known)
        if self.partition_query:
            self._probe(new)
            return
        # Without the partition query a new node (a restarted SuperNode gets a new id) takes the
        # place of a worker whose node is gone, lowest index first; other new nodes are not used.
        gone = [i for i, b in enumerate(self.books) if not b.online and b.node_id not in current]
        for node in new:
            if not gone:
                self._ignored_nodes.add(node)
                log.warning("node %d appeared; no worker is missing, so it gets no jobs", node)
                continue
            self._rejoin(gone.pop(0), node)

    def _probe(self, nodes: list[int]) -> None:
        """Ask ``nodes`` who they are; ``_on_hello`` handles the answers as they arrive."""
        if nodes:
            msgs = [hello_message(n, min(self.ttl, 60.0)) for n in nodes]
            for mid, n in zip(self.grid.push_messages(msgs), nodes):
                self._hello_pending[mid] = n

    def _on_hello(self, node: int, rep: Message) -> None:
        worker = parse_hello(rep)
        if worker is None:
            log.warning("node %d did not answer the hello query", node)
            return
        if not 0 <= worker < len(self.books):
            self._ignored_nodes.add(node)
            log.warning("node %d holds partition %d, outside this run's %d workers", node, worker, len(self.books))
            return
        self._rejoin(worker, node)

    def _rejoin(self, worker: int, node: int) -> None:
        """Worker ``worker`` is on node ``node`` (again): it is online and waits for a job."""
        book = self.books[worker]
        old = book.node_id
        self.worker_of_node.pop(old, None)
        self.worker_of_node[node] = worker
        book.node_id = node
        if not book.online or old != node:
            book.online = True
            self.joined.append(worker)
            log.warning("worker %d (re)joined on node %d", worker, node)

    def pop_joined(self) -> list[int]:
        joined, self.joined = self.joined, []
        return joined

    # ------------------------------------------------------------------ reporting
    def busy_time(self, worker: int, t: float | None = None) -> float:
        """Time ``worker`` spent computing up to time ``t`` (default: now)."""
        t = self.clock.now if t is None else t
        book = self.books[worker]
        busy = book.busy_done
        if self.clock.virtual:
            for job in self.inflight.values():
                if job.worker == worker and job.start_time < t:
                    busy += min(job.finish_time, t) - job.start_time
        return busy

    def idle_share(self, worker: int, t: float | None = None) -> float:
        t = self.clock.now if t is None else t
        if t <= 0:
            return 0.0
        return max(0.0, 1.0 - self.busy_time(worker, t) / t)

    def books_summary(self) -> dict[str, int | float]:
        """The run's books as flat numbers (``AsyncResult.books``): jobs sent, replies accepted,
        updates, rejections in all and per reason, lost and discarded jobs, jobs still in flight."""
        out: dict[str, int | float] = {
            "updates": self.version,
            "jobs-sent": sum(b.jobs_sent for b in self.books),
            "replies-accepted": self.accepted,
            "rejected": sum(self.rejections.values()),
            "lost": sum(b.lost for b in self.books),
            "discarded": sum(b.discarded for b in self.books),
            "in-flight": len(self.inflight),
            "cumulative-stepsize": self.stepsize_sum,
            "time": float(self.clock.now),
        }
        for reason, count in sorted(self.rejections.items()):
            out[f"rejected.{reason}"] = count
        return out

    def summary(self, t: float | None = None) -> dict[str, Any]:
        return {
            "updates": self.version,
            "cumulative_stepsize": self.stepsize_sum,
            "updates_per_worker": [b.updates for b in self.books],
            "rejected": dict(self.rejections),
            "lost_per_worker": [b.lost for b in self.books],
            "discarded_per_worker": [b.discarded for b in self.books],
            "wasted_time": sum(b.wasted for b in self.books),
            "idle_share_per_worker": [self.idle_share(i, t) for i in range(self.num_workers)],
        }
