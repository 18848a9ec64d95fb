"""Jobs out, replies in: pushing Flower Messages and matching replies to the jobs they answer.

Replies are matched by Flower's ``reply_to_message_id``. A reply to a job in flight is buffered
until the completion source consumes it; a second reply to the same job is a ``duplicate`` and a
reply to no job sent is an ``unknown-job`` (both strays); the reply of a cancelled job is
handed to ``on_cancelled_reply`` (its compute time is wasted work); replies to the partition query
go to ``on_hello``; strays to ``on_stray``.

A reply counts only if it comes from the node its message went to, or is an error the SuperLink
sent itself (``fl_rescaled.matching.from_node``). Any other is a stray, ``wrong-node``, not an
outcome of the job it names: that job stays in flight, for its own node's reply or its TTL, so a
node cannot have another's job charged (rejected, its worker set aside) by forging its reply, and
the books still balance. Flower's SuperLink already refuses such replies; the in-process Grid turns
them into an error reply to the forger's own job (``InProcessGrid._execute``).

Nothing waits in silence: while the virtual clock waits for a job's reply, ``collect_replies`` logs
every ``grid_api.WAIT_NOTICE_EVERY`` seconds what it waits for and when the TTL books it lost.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from flwr.app import Message

from fl_rescaled.algorithm import Job
from fl_rescaled.grid_api import AsyncGrid, collect_replies, seconds
from fl_rescaled.matching import from_node
from fl_rescaled.messages import JOB_TYPE, job_content, plain_message

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
    """Jobs out as Flower Messages, replies in, matched to their jobs (see the module docstring)."""

    def __init__(self, grid: AsyncGrid, *, ttl: float, arrayrecord_key: str = "arrays",
                 configrecord_key: str = "config") -> None:
        self.grid = grid
        self.ttl = float(ttl)
        self.keys = (arrayrecord_key, configrecord_key)
        self.inflight: dict[str, Job] = {}  # insertion order = push order: the oldest first
        self.arrived: dict[str, Message] = {}
        self._arrival_order: deque[str] = deque()
        self.finished = RecentIds(100_000)  # answered jobs: a second reply is a duplicate
        self.cancelled: dict[str, Job] = {}  # cancelled jobs whose replies may still arrive
        self.hello_pending: dict[str, int] = {}  # partition-query message id -> node id
        self.on_hello: Callable[[int, Message], None] = lambda node, rep: None
        self.on_cancelled_reply: Callable[[Job, Message], None] = lambda job, rep: None
        self.on_stray: Callable[[str], None] = lambda reason: None

    def push_job(self, job: Job, read: bool = True) -> None:
        """Send ``job`` (its model and config) to its node as a Flower ``train`` Message. ``read``
        False: the virtual clock knows its reply will not be read (its client goes offline first, it
        ends after the budget); a Grid that offers ``push_unread`` (the in-process one) then computes
        it only if it is pulled after all, never ahead of time or in another job's batch."""
        assert job.model is not None
        msg = plain_message(job_content(job.model, job.config, *self.keys), job.node_id, JOB_TYPE, ttl=self.ttl,
                            group_id=str(job.version))
        push = self.grid.push_messages if read else getattr(self.grid, "push_unread", self.grid.push_messages)
        (mid,) = push([msg])
        job.message_id = mid
        job.pushed_at = time.monotonic()
        self.inflight[mid] = job

    def push_hellos(self, msgs: list[Message], nodes: list[int]) -> None:
        for mid, node in zip(self.grid.push_messages(msgs), nodes):
            self.hello_pending[mid] = node

    def done(self, job: Job) -> None:
        """``job`` left the flight (completed or lost); a later reply to it is a duplicate."""
        self.inflight.pop(job.message_id, None)
        self.arrived.pop(job.message_id, None)
        self.finished.add(job.message_id)

    def cancel(self, job: Job) -> Message | None:
        """``job`` is cancelled: its reply, if it already came, else None (a later one is handed
        to ``on_cancelled_reply``)."""
        self.inflight.pop(job.message_id, None)
        rep = self.arrived.pop(job.message_id, None)
        if rep is None:
            self.cancelled[job.message_id] = job
            if len(self.cancelled) > self.finished.limit:  # (replies that never come: do not pile up)
                del self.cancelled[next(iter(self.cancelled))]
        else:
            self.finished.add(job.message_id)
        return rep

    def accept(self, replies: list[Message]) -> None:
        """Buffer pulled replies; book those that answer no job in flight."""
        for rep in replies:
            self.accept_one(rep)

    def accept_one(self, rep: Message) -> bool:
        """Buffer or hand over one reply; False for a stray (booked as such)."""
        mid = rep.metadata.reply_to_message_id
        sent_to = self._sent_to(mid)
        if sent_to is not None and not from_node(rep, sent_to):
            self.on_stray("wrong-node")
            log.warning("ignored a reply to message %r: it comes from node %s, the message went to node %d "
                        "(wrong-node)", mid, rep.metadata.src_node_id, sent_to)
            return False
        if mid in self.hello_pending:
            self.on_hello(self.hello_pending.pop(mid), rep)
        elif mid in self.cancelled:  # a cancelled job finished anyway
            self.finished.add(mid)
            self.on_cancelled_reply(self.cancelled.pop(mid), rep)
        elif mid in self.inflight and mid not in self.arrived:
            self.arrived[mid] = rep
            self._arrival_order.append(mid)
        else:
            reason = "duplicate" if (mid in self.finished or mid in self.arrived) else "unknown-job"
            self.on_stray(reason)
            log.warning("ignored a reply to message %r: %s", mid, reason)
            return False
        return True

    def _sent_to(self, mid: str) -> int | None:
        """The node message ``mid`` went to, if it is still awaited (None: not one of ours, or answered)."""
        if mid in self.hello_pending:
            return self.hello_pending[mid]
        job = self.cancelled.get(mid) or self.inflight.get(mid)
        return None if job is None or mid in self.arrived else job.node_id

    def await_reply(self, job: Job) -> Message | None:
        """Block until the reply to ``job`` has arrived (virtual clock); None past its TTL."""
        mid = job.message_id
        if mid not in self.arrived:
            collect_replies(self.grid, [mid], job.pushed_at + self.ttl, self.accept_one,
                            what=f"the reply to job {job.job_id} (node {job.node_id})",
                            at_deadline=f"its TTL ({seconds(self.ttl)}) books it lost")
        return self.arrived.pop(mid, None)

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
