"""Jobs out, replies in: pushing Flower Messages and matching replies to the jobs they answer.

Replies are matched by Flower's ``reply_to_message_id``. A reply to a job in flight is buffered
until the manager consumes it; a second reply to the same job is a ``duplicate``; a reply to no job
sent is ``unknown-job``; the reply of a cancelled job is dropped as wasted work; replies to the
partition query go to the membership.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from flwr.app import Message
from flwr.serverapp import Grid

from .books import Books
from .jobs import Job

log = logging.getLogger("flwr.fl_rescaled")


class RecentIds:
    """The last ``limit`` ids added (a set that forgets its oldest members: a week-long run's
    message ids would otherwise pile up without end)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._ids: dict[str, None] = {}

    def add(self, mid: str) -> None:
        self._ids[mid] = None
        if len(self._ids) > self.limit:
            del self._ids[next(iter(self._ids))]

    def __contains__(self, mid: object) -> bool:
        return mid in self._ids

    def __len__(self) -> int:
        return len(self._ids)


class Transport:
    def __init__(self, grid: Grid, books: Books, *, ttl: float, poll_interval: float, time_unit: float = 1.0) -> None:
        self.grid = grid
        self.books = books
        self.ttl = float(ttl)
        self.poll_interval = poll_interval
        self.time_unit = time_unit
        self.inflight: dict[str, Job] = {}  # insertion order = push order: the oldest first
        self.arrived: dict[str, Message] = {}
        self._arrival_order: deque[str] = deque()
        self.finished = RecentIds(100_000)  # answered jobs: a second reply is a duplicate
        self.cancelled: dict[str, Job] = {}  # cancelled jobs whose replies may still arrive
        self.hello_pending: dict[str, int] = {}  # partition-query message id -> node id
        self.on_hello: Callable[[int, Message], None] = lambda node, rep: None

    def __getstate__(self) -> dict:  # (a checkpoint: no Grid, no callback, no answered ids)
        state = dict(self.__dict__)
        state.update(grid=None, on_hello=None, finished=RecentIds(self.finished.limit))
        return state

    def push(self, msg: Message, job: Job) -> None:
        (mid,) = self.grid.push_messages([msg])
        job.message_id = mid
        job.pushed_at = time.monotonic()
        self.inflight[mid] = job
        self.books.workers[job.worker].pending[mid] = job

    def push_hellos(self, msgs: list[Message], nodes: list[int]) -> None:
        for mid, node in zip(self.grid.push_messages(msgs), nodes):
            self.hello_pending[mid] = node

    def done(self, job: Job) -> None:
        """``job`` left the flight (completed, lost or cancelled)."""
        self.inflight.pop(job.message_id, None)
        self.books.workers[job.worker].pending.pop(job.message_id, None)
        self.finished.add(job.message_id)

    def accept(self, replies: list[Message]) -> None:
        """Buffer pulled replies; count those that answer no job in flight."""
        for rep in replies:
            mid = rep.metadata.reply_to_message_id
            if mid in self.hello_pending:
                self.on_hello(self.hello_pending.pop(mid), rep)
            elif mid in self.cancelled:  # a cancelled job finished anyway: drop it
                self.drop_cancelled(self.cancelled.pop(mid), rep)
            elif mid in self.inflight and mid not in self.arrived:
                self.arrived[mid] = rep
                self._arrival_order.append(mid)
            else:
                reason = "duplicate" if (mid in self.finished or mid in self.arrived) else "unknown-job"
                self.books.record_rejection(reason)
                log.warning("rejected a reply to message %r: %s", mid, reason)

    def drop_cancelled(self, job: Job, rep: Message) -> None:
        """The reply of a cancelled job (wall clock): unused; its compute time is wasted work."""
        self.finished.add(job.message_id)
        if rep.has_content() and "metrics" in rep.content:
            spent = float(rep.content["metrics"].get("compute-time", 0.0)) / self.time_unit
            book = self.books.workers[job.worker]
            book.wasted += spent
            book.busy_done += spent

    def await_reply(self, job: Job) -> Message | None:
        """Block until the reply to ``job`` has arrived (virtual clock); None past its TTL."""
        mid = job.message_id
        deadline = job.pushed_at + self.ttl
        wait = getattr(self.grid, "wait_messages", None)  # an in-process Grid computing ahead
        while mid not in self.arrived:
            if wait is not None:
                wait([mid], timeout=max(0.0, deadline - time.monotonic()))
            self.accept(list(self.grid.pull_messages([mid])))
            if mid in self.arrived:
                break
            if time.monotonic() > deadline:
                return None
            time.sleep(self.poll_interval)
        return self.arrived.pop(mid)

    def next_arrival(self) -> str | None:
        """The oldest buffered reply (wall clock), pulling new ones only when none is buffered."""
        mid = self._pop_arrival()
        if mid is None:
            self.accept(list(self.grid.pull_messages([*self.inflight, *self.hello_pending])))
            mid = self._pop_arrival()
        return mid

    def _pop_arrival(self) -> str | None:
        while self._arrival_order:
            mid = self._arrival_order.popleft()
            if mid in self.arrived:
                return mid
        return None

    def expired_job(self) -> Job | None:
        """The oldest job in flight if it is past its TTL (every job has the same TTL)."""
        for job in self.inflight.values():
            return job if time.monotonic() - job.pushed_at > self.ttl else None
        return None
