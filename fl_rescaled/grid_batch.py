"""The in-process Grid's lazy batches: a job's reply is computed when it is pulled, together with
every pending job that can share the call.

A job's reply depends only on its message (and its node's context), so the Grid may compute it any
time before the strategy pulls it. ``LazyBatches`` holds the pending jobs of a ``BatchedClientApp``
grouped by their batch key; when one is pulled and not yet computed, its whole group (the pending
jobs with the same key whose nodes are online) is answered at once, cut into calls by
``plan_chunks``, and the other replies wait until they are pulled. Which jobs share a call is
therefore a function of the order of pushes, pulls and discards alone: the same seed gives the same
batches, and so the same bits, for any number of threads. A job pushed unread (``push_unread``: the
virtual clock knows its reply will not be read) is a group of its own, computed only if pulled. With
``workers`` ≥ 2 the calls of one batch run in parallel, one on the calling thread and the others on
the Grid's pool, each with the caller's torch thread count.

With ``workers`` ≥ 2, a job whose ClientApp offers ``launch`` (``BatchEntry.launch``) and takes it is
started when it is pushed (the project's ClientApp sends CPU MNIST gradients to a worker process) and
collected when pulled; a launch that cannot give its reply leaves the job to be computed alone, and the
jobs started and not pulled are given back when the Grid closes (or is dropped).

A batch call that raises is redone one message at a time, so a failing job gets its own error reply
exactly as without batching. A node taken down after its job was computed still answers with
NODE_UNAVAILABLE when the job is pulled, as if it had been computed then.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from flwr.app import Context, Message

from .batching import BatchEntry, Launched, plan_chunks


#: The batch key of a job pushed unread: a group of its own.
_ALONE = object()


def _cancel_all(launched: dict) -> None:
    while launched:
        _, (_, _, started) = launched.popitem()
        try:
            started.cancel()
        except Exception:  # noqa: BLE001 - (a worker already gone has nothing to give back)
            pass


class BatchHost(Protocol):
    """What lazy batches use of the in-process Grid (``fl_rescaled.grid.InProcessGrid``)."""

    offline: set[int]
    workers: int

    def context(self, node_id: int, partition: int | None = None) -> Context: ...

    def _pooled(self, fn: Callable, *args: Any) -> Future: ...

    def _execute(self, msg: Message) -> Message: ...

    def _finish(self, msg: Message, reply: Message | None, ctx: Context, partition: int | None = -1) -> Message: ...


class LazyBatches:
    """Pending and computed jobs of one Grid whose ClientApp offers a batch entry."""

    def __init__(self, grid: BatchHost, entry: BatchEntry, retry: Callable) -> None:
        self.grid = grid
        self.entry = entry
        self._retry = retry
        self.groups: dict[Hashable, dict[str, Message]] = {}  # key -> pending jobs, in push order
        self.key_of: dict[str, Hashable] = {}
        self.done: dict[str, tuple[Message, Message]] = {}  # computed, not yet pulled
        self.launched: dict[str, tuple[Message, Context, Launched]] = {}  # started when pushed (``launch``)
        # (a Grid dropped with jobs started elsewhere gives their places back there: see ``close``)
        weakref.finalize(self, _cancel_all, self.launched)
        #: batches formed, calls made and jobs answered by them (jobs run one by one are not counted)
        self.formed = 0
        self.calls = 0
        self.jobs = 0

    def push(self, mid: str, msg: Message, alone: bool = False) -> bool:
        """Hold ``msg`` until it is pulled; False if it cannot be batched (the Grid runs it alone).
        ``alone``: its reply is not expected to be pulled (``InProcessGrid.push_unread``): it is never
        launched, and if it is pulled it is computed by itself, a batch of one."""
        try:
            key = self.entry.key(msg)
        except Exception:  # noqa: BLE001 - a message the key cannot read goes one by one (and fails there)
            key = None
        if key is None:
            return False
        if alone:
            key = (_ALONE, mid)
        elif self.entry.launch is not None and self.grid.workers > 1 and msg.metadata.dst_node_id not in self.grid.offline:
            ctx = self.grid.context(msg.metadata.dst_node_id)
            try:
                started = self.entry.launch(msg, ctx)
            except Exception:  # noqa: BLE001 - not started: it waits for its batch as any other
                started = None
            if started is not None:
                self.launched[mid] = (msg, ctx, started)
                return True
        self.groups.setdefault(key, {})[mid] = msg
        self.key_of[mid] = key
        return True

    def close(self) -> None:
        """Forget the jobs started elsewhere and not pulled (their replies are not wanted any more)."""
        _cancel_all(self.launched)

    def holds(self, mid: str) -> bool:
        return mid in self.key_of or mid in self.done or mid in self.launched

    def discard(self, mid: str) -> None:
        key = self.key_of.pop(mid, None)
        if key is not None:
            group = self.groups[key]
            group.pop(mid, None)
            if not group:
                del self.groups[key]
        self.done.pop(mid, None)
        started = self.launched.pop(mid, None)
        if started is not None:
            started[2].cancel()

    def reply(self, mid: str) -> Message | None:
        """The reply to ``mid`` (computing its batch if needed); None if it is not held here."""
        started = self.launched.pop(mid, None)
        if started is not None:
            return self._collect(*started)
        got = self.done.pop(mid, None)
        if got is None:
            if mid not in self.key_of:
                return None
            self._compute(self.key_of[mid], mid)
            got = self.done.pop(mid)
        msg, rep = got
        if msg.metadata.dst_node_id in self.grid.offline:
            return self.grid._execute(msg)  # NODE_UNAVAILABLE, as if computed now
        return rep

    def _collect(self, msg: Message, ctx: Context, started: Launched) -> Message:
        """A launched job's reply; computed here, alone, if its launch cannot give it."""
        if msg.metadata.dst_node_id in self.grid.offline:
            started.cancel()
            return self.grid._execute(msg)  # NODE_UNAVAILABLE
        try:
            rep = started.reply()
        except Exception:  # noqa: BLE001 - (a worker process that died): the same job, in process
            rep = None
        return self.grid._finish(msg, rep, ctx)

    def _compute(self, key: Hashable, mid: str) -> None:
        group = self.groups.pop(key)
        offline = self.grid.offline
        if group[mid].metadata.dst_node_id in offline:
            msg = group.pop(mid)
            del self.key_of[mid]
            if group:
                self.groups[key] = group
            self.done[mid] = (msg, self.grid._execute(msg))
            return
        members = [(m, msg) for m, msg in group.items() if msg.metadata.dst_node_id not in offline]
        later = {m: msg for m, msg in group.items() if msg.metadata.dst_node_id in offline}
        if later:
            self.groups[key] = later
        for m, _ in members:
            del self.key_of[m]
        msgs = [msg for _, msg in members]
        contexts = [self.grid.context(msg.metadata.dst_node_id) for msg in msgs]
        chunks = plan_chunks(len(msgs), self.entry.chunk_size(msgs[0]))
        # A node's messages never run at the same time: with two jobs of one node in the batch, its
        # calls run in turn (its context's state may change from one to the next).
        parallel = len({msg.metadata.dst_node_id for msg in msgs}) == len(msgs)
        replies = self._run_chunks([(msgs[s], contexts[s]) for s in chunks], parallel)
        self.formed += 1
        self.calls += len(chunks)
        self.jobs += len(msgs)
        for (m, msg), ctx, rep in zip(members, contexts, replies):
            self.done[m] = (msg, self.grid._finish(msg, rep, ctx))

    def _run_chunks(self, chunks: list[tuple[Sequence[Message], Sequence[Context]]],
                    parallel: bool = True) -> list[Message | None]:
        """Every chunk's replies, in order: the first on this thread, the others on the pool if any
        (and ``parallel``), else all in turn."""
        futures: list[Future] = []
        if self.grid.workers > 1 and parallel and len(chunks) > 1:
            futures = [self.grid._pooled(self._call, *c) for c in chunks[1:]]
            out = self._call(*chunks[0])
            for fut in futures:
                out.extend(fut.result())
            return out
        out = []
        for c in chunks:
            out.extend(self._call(*c))
        return out

    def _call(self, msgs: Sequence[Message], contexts: Sequence[Context]) -> list[Message | None]:
        """One batch call; ``None`` for a message whose reply must be computed alone (the call
        raised, or returned the wrong number of replies)."""
        try:
            replies = self._retry(self.entry.fn, list(msgs), list(contexts))
        except Exception:  # noqa: BLE001 - redone one by one: each failing job gets its own error reply
            return [None] * len(msgs)
        if not isinstance(replies, list) or len(replies) != len(msgs):
            return [None] * len(msgs)
        return replies
