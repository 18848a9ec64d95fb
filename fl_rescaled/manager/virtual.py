"""The virtual clock's completion source: when each job runs, and what happens next.

Each worker serves its jobs first in, first out: a job starts when the worker is free and takes a
compute time drawn from the clock's model (``fl_rescaled.delays``) when it starts. Completions come
out of a heap in order of finishing time, ties broken by worker index, then job id (O(log C) per
event for C jobs in flight, whatever the number of workers), whatever order the Grid computes replies
in; the source then waits for that job's reply (an in-process Grid computes it now, or has computed
it ahead). Cancelled jobs leave the heap lazily.

With an availability model (``fl_rescaled.availability``) a job whose client goes offline before it
finishes is lost at that moment (``offline``: its reply is never computed), and the source tells
the manager when clients come back: a worker that lost its job that way (``joined``), and a slot
that found no client online (``woken``, at the earliest time an idle client is online again).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence

import numpy as np
from flwr.app import Message

from fl_rescaled.clock import VirtualClock
from fl_rescaled.stepsizes import TauTable

from .jobs import Job
from .membership import Membership
from .observers import ManagerObserver
from .transport import Transport

#: Event kinds besides jobs, in the order they are handled at equal times.
JOINED, WOKEN = 0, 1


class VirtualSource:
    virtual = True

    def __init__(self, clock: VirtualClock, transport: Transport, membership: Membership,
                 observers: list[ManagerObserver]) -> None:
        self.clock = clock
        self.availability = clock.availability
        self.transport = transport
        self.membership = membership
        self.observers = observers
        self.free_at = np.zeros(0)  # per worker: the virtual time its queue empties
        self._heap: list[tuple[float, int, int, str]] = []  # (time, worker, job id, message id)
        self._cut: dict[str, float] = {}  # jobs whose client goes offline before they finish
        self._events: list[tuple[float, int, int]] = []  # (time, kind, worker)
        self._returning: set[int] = set()  # workers with a JOINED event pending (one each)
        self.woken = 0  # slots that waited for a client to come back, and can be filled now
        self.last_delivery = np.zeros(0)  # C < N, periods estimated: each worker's last accepted reply

    def tau_table(self, num_workers: int, weights: Sequence[float] | None) -> TauTable:
        """The exact mean compute times of the clock's model."""
        if self.clock.delays.num_clients < num_workers:
            raise ValueError(f"the clock knows {self.clock.delays.num_clients} workers, the grid has {num_workers}")
        self.free_at = np.zeros(num_workers)
        return TauTable(num_workers, self.clock.delays.means()[:num_workers].tolist(), weights)

    def online(self, worker: int) -> bool:
        return self.availability is None or self.availability.online(worker, self.clock.now)

    def online_mask(self, workers: np.ndarray) -> np.ndarray:
        if self.availability is None:
            return np.ones(workers.shape, bool)
        return self.availability.online_mask(workers, self.clock.now)

    def dispatched(self, job: Job) -> None:
        """``job`` was pushed: it starts when its worker is free and competes for the next event."""
        w = job.worker
        job.start_time = start = max(self.clock.now, float(self.free_at[w]))
        job.finish_time = start + self.clock.job_duration(w, start)
        self.free_at[w] = job.finish_time
        heapq.heappush(self._heap, (self._ends_at(job), w, job.job_id, job.message_id))

    def _ends_at(self, job: Job) -> float:
        """When ``job`` ends: its finishing time, or earlier when its client goes offline first (then
        it is cut there)."""
        if self.availability is not None:
            off = self.availability.next_off(job.worker, job.start_time)
            if off < job.finish_time:
                self._cut[job.message_id] = off
                return off
        return job.finish_time

    def returns(self, workers: np.ndarray) -> None:
        """Tell the manager when each of ``workers`` (offline now) comes online (``joined``)."""
        if self.availability is not None and workers.size:
            for w, t in zip(workers.tolist(), self.availability.next_on_many(workers, self.clock.now).tolist()):
                self._return_at(w, t)

    def _return_at(self, worker: int, t: float) -> None:
        if np.isfinite(t) and worker not in self._returning:
            self._returning.add(worker)
            heapq.heappush(self._events, (t, JOINED, worker))

    def set_events(self, events: list[tuple[float, int, int]]) -> None:
        """The pending events of a resumed run (a heap already)."""
        self._events = list(events)
        self._returning = {w for _, kind, w in events if kind == JOINED}

    def park(self, idle: np.ndarray) -> None:
        """A slot found no idle client online: wake it when the first of ``idle`` comes back."""
        if self.availability is not None and idle.size:
            back = float(self.availability.next_on_many(idle, self.clock.now).min())
            if np.isfinite(back):
                heapq.heappush(self._events, (back, WOKEN, -1))

    def next(self, budget: float) -> tuple[Job, Message | None, float, str | None] | None:
        """The next job to end and its reply (None past its TTL: lost; ``offline``: its client left),
        or None once the next event is after ``budget``, or when clients came back (``woken``, the
        membership's ``joined``): the caller gives them work, then asks again."""
        heap, inflight, events = self._heap, self.transport.inflight, self._events
        while heap and heap[0][3] not in inflight:
            self._cut.pop(heapq.heappop(heap)[3], None)  # cancelled or already completed
        t_job = heap[0][0] if heap else np.inf
        if events and events[0][0] <= t_job:
            if events[0][0] > budget:
                return None
            t, kind, worker = heapq.heappop(events)
            self.clock.advance(t)
            if kind == JOINED:
                self._returning.discard(worker)
                self.membership.joined.append(worker)
            else:
                self.woken += 1
            return None
        if t_job > budget:
            return None
        job = inflight[heap[0][3]]
        off = self._cut.pop(job.message_id, None)
        if off is not None:
            heapq.heappop(heap)
            self.clock.advance(off)
            self.transport.grid.discard_messages([job.message_id])
            self._return_at(job.worker, self.availability.next_on(job.worker, off))  # type: ignore[union-attr]
            return job, None, off, "offline"
        t0 = time.perf_counter()
        reply = self.transport.await_reply(job)
        for obs in self.observers:
            obs.reply_awaited(job, time.perf_counter() - t0)
        self.clock.advance(job.finish_time)
        return job, reply, job.finish_time, None if reply is not None else "lost"

    def work(self, job: Job, t: float | None = None) -> float:
        """The compute time of a job that ended at ``t`` (default: its finishing time)."""
        end = job.finish_time if t is None else min(t, job.finish_time)
        return max(0.0, end - job.start_time)

    def cancel(self, job: Job) -> float:
        """Stop ``job`` now (its worker is free at once if it was its last job); the compute time it
        had used. An in-process Grid does not compute it at all."""
        now = self.clock.now
        elapsed = max(0.0, min(now, job.finish_time) - job.start_time)
        w = job.worker
        if job.finish_time >= self.free_at[w]:
            self.free_at[w] = min(self.free_at[w], max(now, job.start_time))
        self._cut.pop(job.message_id, None)
        self.transport.done(job)
        self.transport.grid.discard_messages([job.message_id])
        return elapsed

    def busy(self, done: np.ndarray, t: float) -> np.ndarray:
        """Each worker's compute time up to ``t``: its finished jobs' (``done``) plus the part of its
        jobs in flight that ran before ``t``."""
        busy = done.copy()
        for job in self.transport.inflight.values():
            if job.start_time < t:
                busy[job.worker] += min(job.finish_time, self._cut.get(job.message_id, job.finish_time), t) \
                    - job.start_time
        return busy

    def resume(self, jobs: list[Job], free_at: np.ndarray) -> None:
        """After a checkpoint was read: ``jobs`` (in flight, in push order, with their models) are
        pushed again as they were, with the same finishing times, so their replies are the ones they
        would have been."""
        self.free_at = free_at
        for job in jobs:
            self.transport.push_job(job)
            self._heap.append((self._ends_at(job), job.worker, job.job_id, job.message_id))
        heapq.heapify(self._heap)

    def delivered(self, worker: int, t: float, periods: TauTable, how: str, smoothing: float, count: int) -> None:
        """C < N: worker's mean time between deliveries, from its ``count``-th delivery at ``t``.
        ``average``: (t + p_0) / (count + 1) with p_0 the starting (mean-field) value; ``ema``: an
        exponential moving average of the intervals (speeds that change)."""
        if how == "average":
            periods.update(worker, (t + periods.prior[worker]) / (count + 1))
            return
        measured = max(t - float(self.last_delivery[worker]), 1e-12)
        self.last_delivery[worker] = t
        periods.update(worker, (1 - smoothing) * periods.taus[worker] + smoothing * measured)

    def accepted(self, job: Job, metrics: dict) -> float:
        """An accepted reply: its compute time (the virtual clock's, whatever the client says)."""
        del metrics
        return self.work(job)

    @staticmethod
    def node_gone(job: Job) -> None:
        """(The availability model, not the nodes, says who is online on the virtual clock.)"""
