"""The virtual clock's completion source: when each job runs, and which one finishes next.

Each worker serves its jobs first in, first out: a job starts when the worker is free and takes a
compute time drawn from the delay model when it starts. Completions come out of a heap in order of
finishing time, ties broken by worker index, then job id (O(log n) per event, whatever the number
of workers), whatever order the Grid computes replies in; the source then waits for that job's
reply (an in-process Grid computes it now, or has computed it ahead). Cancelled jobs leave the heap
lazily. Every worker is online for the whole run.
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
from .observers import ManagerObserver
from .transport import Transport


class VirtualSource:
    virtual = True

    def __init__(self, clock: VirtualClock, transport: Transport, observers: list[ManagerObserver]) -> None:
        self.clock = clock
        self.transport = transport
        self.observers = observers
        self.free_at = np.zeros(0)  # per worker: the virtual time its queue empties
        self._heap: list[tuple[float, int, int, str]] = []

    def tau_table(self, num_workers: int, weights: Sequence[float] | None) -> TauTable:
        """The exact mean compute times of the delay model."""
        if self.clock.delays.num_workers < num_workers:
            raise ValueError(f"the clock knows {self.clock.delays.num_workers} workers, the grid has {num_workers}")
        self.free_at = np.zeros(num_workers)
        return TauTable(num_workers, self.clock.delays.taus[:num_workers], weights)

    def dispatched(self, job: Job) -> None:
        """``job`` was pushed: it starts when its worker is free and competes for the next completion."""
        w = job.worker
        job.start_time = start = max(self.clock.now, float(self.free_at[w]))
        job.finish_time = start + self.clock.job_duration(w)
        self.free_at[w] = job.finish_time
        heapq.heappush(self._heap, (job.finish_time, w, job.job_id, job.message_id))

    def next(self, budget: float) -> tuple[Job, Message | None, float, str | None] | None:
        """The job that finishes first and its reply (None past its TTL: lost), or None once the next
        one would finish after ``budget``."""
        heap, inflight = self._heap, self.transport.inflight
        while heap and heap[0][3] not in inflight:
            heapq.heappop(heap)  # cancelled or already completed
        if not heap or heap[0][0] > budget:
            return None
        job = inflight[heap[0][3]]
        t0 = time.perf_counter()
        reply = self.transport.await_reply(job)
        for obs in self.observers:
            obs.reply_awaited(job, time.perf_counter() - t0)
        self.clock.advance(job.finish_time)
        return job, reply, job.finish_time, None if reply is not None else "lost"

    def work(self, job: Job) -> float:
        """The compute time of a finished job."""
        return job.finish_time - job.start_time

    def cancel(self, job: Job) -> float:
        """Stop ``job`` now (its worker is free at once if it was its last job); the compute time it
        had used. An in-process Grid does not compute it at all."""
        now = self.clock.now
        elapsed = max(0.0, min(now, job.finish_time) - job.start_time)
        w = job.worker
        if job.finish_time >= self.free_at[w]:
            self.free_at[w] = min(self.free_at[w], max(now, job.start_time))
        self.transport.done(job)
        self.transport.grid.discard_messages([job.message_id])
        return elapsed

    def busy(self, done: np.ndarray, t: float) -> np.ndarray:
        """Each worker's compute time up to ``t``: its finished jobs' (``done``) plus the part of its
        jobs in flight that ran before ``t``."""
        busy = done.copy()
        for job in self.transport.inflight.values():
            if job.start_time < t:
                busy[job.worker] += min(job.finish_time, t) - job.start_time
        return busy

    def resume(self, jobs: list[Job], free_at: np.ndarray) -> None:
        """After a checkpoint was read: ``jobs`` (in flight, in push order, with their models) are
        pushed again as they were, with the same finishing times, so their replies are the ones they
        would have been."""
        self.free_at = free_at
        for job in jobs:
            self.transport.push_job(job)
        self._heap = [(j.finish_time, j.worker, j.job_id, j.message_id) for j in jobs]
        heapq.heapify(self._heap)

    def accepted(self, job: Job, metrics: dict) -> float:
        """An accepted reply: its compute time (the virtual clock's, whatever the client says)."""
        del metrics
        return self.work(job)

    @staticmethod
    def node_gone(job: Job) -> None:
        """(Every node stays online on the virtual clock.)"""
