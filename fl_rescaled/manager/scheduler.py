"""The virtual clock's scheduler: when each job starts and finishes, and which finishes next.

Each worker serves its jobs first in, first out: a job starts when the worker is free and takes a
compute time drawn from the delay model when it starts. Completions come out of a heap in order of
finishing time, ties broken by worker index, then job id: O(log n) per event, whatever the number
of workers. Cancelled jobs are dropped from the heap lazily.
"""

from __future__ import annotations

import heapq

from fl_rescaled.clock import VirtualClock

from .books import WorkerBook
from .jobs import Job


class VirtualScheduler:
    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, int, str]] = []

    def schedule(self, job: Job, book: WorkerBook) -> None:
        """Give ``job`` its start and finish times (queued behind the worker's earlier jobs)."""
        job.start_time = start = max(self.clock.now, book.free_at)
        job.finish_time = book.free_at = start + self.clock.job_duration(job.worker)

    def track(self, job: Job) -> None:
        """``job`` is in flight (its message id is known): it competes for the next completion."""
        heapq.heappush(self._heap, (job.finish_time, job.worker, job.job_id, job.message_id))

    def rebuild(self, jobs: list[Job]) -> None:
        """The heap of ``jobs`` (in flight, with their message ids), as after ``track`` of each."""
        self._heap = [(j.finish_time, j.worker, j.job_id, j.message_id) for j in jobs]
        heapq.heapify(self._heap)

    def next_job(self, inflight: dict[str, Job]) -> Job | None:
        """The job in flight that finishes first (None if there is none)."""
        heap = self._heap
        while heap:
            job = inflight.get(heap[0][3])
            if job is not None:
                return job
            heapq.heappop(heap)  # cancelled or already completed
        return None

    def cancel(self, job: Job, book: WorkerBook) -> float:
        """Stop ``job`` now; the worker is free at once if it was its last job. Returns the compute
        time the job had used (booked as discarded work when positive)."""
        now = self.clock.now
        elapsed = max(0.0, min(now, job.finish_time) - job.start_time)
        if job.finish_time >= book.free_at:
            book.free_at = min(book.free_at, max(now, job.start_time))
        return elapsed
