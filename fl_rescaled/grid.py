"""An in-process ``Grid``: real Flower ``Message``s handed to a real ``ClientApp``, no polling.

Flower's own runtimes poll every 0.1 s per node (simulation) or seconds (deployment); here a job
is executed the moment its reply is pulled, in the same process, so a run goes as fast as its
computation. Each node has its own ``Context`` (``partition-id``/``num-partitions`` in its node
config, a persistent ``state``), exactly as a SuperNode would give it. A ClientApp that raises is
turned into an error reply with Flower's code 2 (CLIENT_APP_RAISED_EXCEPTION), as the runtimes do;
a reply that does not answer its message from its node (a reply to another node's message, to no
message) is turned into an error reply that says so (``fl_rescaled.matching``).

``threaded=True`` runs each node's jobs on its own worker thread instead (in push order), and
``pull_messages`` returns only the replies that are ready, as Flower's runtimes do; with emulated
compute times (clients that sleep) this is a one-process stand-in for a deployment on the wall
clock.

``workers=N`` (N ≥ 2, virtual clock) gives the Grid a pool of N threads. ``submit`` runs work there
(the strategies' central evaluation, which then overlaps the event loop). With ``ahead=True`` (the
default) every pushed message is also computed at once on the pool instead of when it is pulled: at
any moment many jobs are in flight and each reply depends only on its message, so they can be
computed ahead, in parallel, while the strategy consumes them in virtual-time order
(``wait_messages`` blocks on the one it needs). A node's messages never run at the same time as
each other. Each pool thread runs torch with the calling thread's intra-op thread count, so every
reply and evaluation has the same bits as with ``workers=1``. Threads, not processes: measured on
2 cores, a job's IPC (two 400 KB copies through pipes) costs more than it saves, while the parts of
a job that release the GIL (torch's kernels) run in parallel on threads.

``batch=True`` (the default; virtual clock): when the ClientApp offers a batch entry
(``fl_rescaled.batching``), a job is computed only when pulled, together with every pending job
that can share the call (``fl_rescaled.grid_batch``); ``ahead`` is then off, and ``workers`` ≥ 2
run the calls of one batch in parallel. Batches depend on the order of events only, so the bits
are the same for any ``workers``.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run as FlowerRun
from flwr.supercore.task_identity import TaskIdentity

from .batching import batch_entry
from .grid_api import set_message_id
from .grid_batch import LazyBatches
from .matching import mismatch, unmatched_error


_ALLOCATOR_TUNED = False
log = logging.getLogger("flwr.fl_rescaled")


def retry_ast_race(fn: Callable, *args: Any, attempts: int = 3) -> Any:
    """``fn(*args)``, again (up to ``attempts`` times) if it failed only because two threads built
    Python ASTs at once: CPython 3.11 shares the AST constructor's recursion counter between
    threads and may raise ``SystemError: AST constructor recursion depth mismatch``
    (python/cpython#106905). ``np.load`` (``Array.numpy()``, ``to_torch_state_dict()``) parses
    every array header that way, so a ClientApp and an evaluation on two pool threads can trip it.
    Jobs and evaluations are pure functions of their message, so a second attempt gives the same
    bits."""
    for attempt in range(attempts):
        try:
            return fn(*args)
        except SystemError as exc:
            if "AST constructor recursion depth mismatch" not in str(exc) or attempt == attempts - 1:
                raise
            log.debug("retrying %s after CPython's thread race in the AST constructor: %s",  # (same bits: nothing
                      getattr(fn, "__name__", "a job"), exc)  # for the user to do)
    raise AssertionError("unreachable")


def tune_allocator() -> bool:
    """Keep large buffers on the heap (glibc): no mmap/munmap and page faults per message.

    Every update allocates a few model-sized (~400 KB) buffers; above glibc's mmap threshold each
    one is a fresh mapping whose pages fault in on first touch, which costs more than the copy.
    Raising the mmap and trim thresholds lets those buffers be reused. No-op off glibc. (What it
    was measured to do: docs/performance.md, "The allocator".)
    """
    global _ALLOCATOR_TUNED  # noqa: PLW0603
    if _ALLOCATOR_TUNED:
        return True
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 256 << 20) == 1 and libc.mallopt(m_trim_threshold, 512 << 20) == 1
    except (OSError, AttributeError):
        ok = False
    _ALLOCATOR_TUNED = ok
    return ok


#: Above this many nodes, a node's Context is kept between messages only if its ClientApp changed it.
KEEP_ALL_CONTEXTS = 4096


def node_ids(n: int, seed: int, ordered: bool = False) -> list[int]:
    """``n`` distinct node ids in [2^20, 2^62) drawn with ``seed`` (ascending when ``ordered``)."""
    rng = np.random.default_rng((seed, 0x9E1D))
    ids = _distinct(rng.integers(1 << 20, 1 << 62, size=n + 16))
    while ids.size < n:  # (collisions are rare: 1 in 10^9 for a million ids)
        ids = _distinct(np.concatenate([ids, rng.integers(1 << 20, 1 << 62, size=n)]))
    ids = ids[ids != SUPERLINK_NODE_ID]
    chosen = ids[rng.permutation(ids.size)[:n]]
    return (np.sort(chosen) if ordered else chosen).tolist()


def _distinct(ids: np.ndarray) -> np.ndarray:
    """The sorted distinct values (``np.unique``'s result; a sort is faster than its hash for ids)."""
    ids = np.sort(ids)
    return ids[np.concatenate(([True], ids[1:] != ids[:-1]))] if ids.size else ids


def set_server_identity(run_id: int) -> None:
    """Let this process build instruction messages as the ServerApp of run ``run_id`` does."""
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    TaskIdentity.task_id = 0


class InProcessGrid(Grid):
    """Runs ``client_app`` for node i (``partition-id`` i) on demand, in this process."""

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        *,
        run_config: dict[str, Any] | None = None,
        node_configs: list[dict[str, Any]] | None = None,
        run_id: int = 1,
        seed: int = 0,
        threaded: bool = False,
        workers: int = 1,
        ahead: bool = True,
        ordered_ids: bool = False,
        batch: bool = True,
    ) -> None:
        if num_nodes < 1:
            raise ValueError("num_nodes must be at least 1")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        self.client_app = client_app
        tune_allocator()
        self._run = FlowerRun.create_empty(run_id)
        set_server_identity(run_id)
        # Node ids look like Flower's (large random integers) so nothing relies on them being 0..n-1,
        # nor, unless ``ordered_ids``, on their order being the partitions'.
        self.node_ids = node_ids(num_nodes, seed, ordered_ids)
        self.partition_order = bool(ordered_ids)  # (an AsyncGrid extra: node-id order is partition order)
        ids = np.array(self.node_ids, dtype=np.int64)
        self._by_id = np.argsort(ids)  # node id -> partition by binary search (a population is large)
        self._sorted_ids = ids[self._by_id]
        self._node_configs = node_configs
        self._run_config = dict(run_config or {})
        #: made on a node's first message; with more than KEEP_ALL_CONTEXTS nodes, a context the ClientApp
        #: left as it was made is dropped after its message (remade alike on the next)
        self.contexts: dict[int, Context] = {}
        self._pending: dict[str, Message] = {}
        self._next_id = 0
        self.messages_pushed = 0
        self.threaded = threaded
        self._futures: dict[str, Any] = {}
        self._executors: dict[int, Any] = {}
        self.offline: set[int] = set()  # nodes taken down with ``set_online`` (tests)
        #: Replies are computed when pulled, so a strategy's default clock is the virtual one
        #: (with threads, nodes compute concurrently in real time: the wall clock).
        self.virtual_time = not threaded
        self.workers = 1 if threaded else workers
        self.ahead = bool(ahead) and self.workers > 1
        self._pool: ThreadPoolExecutor | None = None
        self._node_locks: dict[int, threading.Lock] = {}
        self._torch_threads: int | None = None  # the caller's torch intra-op threads, mirrored in the pool
        self._local = threading.local()  # (per thread: the torch threads set, ``push_unread``'s flag)
        #: Lazy batches (``fl_rescaled.grid_batch``) when the ClientApp offers a batch entry, the clock is
        #: virtual and ``batch`` is on; jobs that cannot be batched run one by one, as without it.
        # (A subclass that overrides ``_execute`` customises single jobs: it keeps them single.)
        own_execute = type(self)._execute is InProcessGrid._execute
        entry = batch_entry(client_app) if batch and not threaded and own_execute else None
        self.batches = LazyBatches(self, entry, retry_ast_race) if entry is not None else None
        if self.batches is not None:
            self.ahead = False

    def context(self, node_id: int, partition: int | None = None) -> Context:
        """The node's ``Context`` (made on first use, as a SuperNode makes it when it starts)."""
        ctx = self.contexts.get(node_id)
        if ctx is None:
            i = self._partition(node_id) if partition is None else partition
            if i is None:
                raise KeyError(node_id)
            ctx = self.contexts[node_id] = Context(run_id=self._run.run_id, node_id=node_id,
                                                   node_config=self._fresh_config(i), state=RecordDict(),
                                                   run_config=dict(self._run_config))
        return ctx

    def _fresh_config(self, i: int | None) -> dict[str, Any]:
        cfg: dict[str, Any] = {"partition-id": i, "num-partitions": len(self.node_ids)}
        if self._node_configs is not None and i is not None:
            cfg.update(self._node_configs[i])
        return cfg

    def _partition(self, node_id: int) -> int | None:
        """The partition of node ``node_id`` (None: not a node of this Grid)."""
        k = int(self._sorted_ids.searchsorted(node_id))
        if k < self._sorted_ids.size and int(self._sorted_ids[k]) == node_id:
            return int(self._by_id[k])
        return None

    def node_config(self, node_id: int) -> dict[str, Any]:
        """The node config of ``node_id`` (``partition-id``, ``num-partitions``, user keys such as ``tau``)."""
        return dict(self.context(node_id).node_config)

    def set_online(self, node_id: int, online: bool) -> None:
        """Take a node down (its jobs fail with Flower's NODE_UNAVAILABLE) or bring it back."""
        (self.offline.discard if online else self.offline.add)(node_id)

    def close(self) -> None:
        if self.batches is not None:
            self.batches.close()
        for ex in [*self._executors.values(), *([self._pool] if self._pool is not None else [])]:
            ex.shutdown(wait=True, cancel_futures=True)
        self._executors.clear()
        self._pool = None

    # -- the pool (workers ≥ 2)
    def _pooled(self, fn: Callable, *args: Any) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="inprocess")
        torch = sys.modules.get("torch")
        if torch is not None:
            self._torch_threads = torch.get_num_threads()
        return self._pool.submit(self._in_pool, fn, *args)

    def _in_pool(self, fn: Callable, *args: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and self._torch_threads is not None:
            if getattr(self._local, "torch_threads", None) != self._torch_threads:
                torch.set_num_threads(self._torch_threads)  # (per thread: OpenMP's setting is)
                self._local.torch_threads = self._torch_threads
        return fn(*args)

    def _execute_in_order(self, msg: Message) -> Message:
        lock = self._node_locks.setdefault(msg.metadata.dst_node_id, threading.Lock())
        with lock:
            return self._execute(msg)

    def submit(self, fn: Callable, *args: Any) -> Future | None:
        """Run ``fn(*args)`` on the pool (None without one: the caller runs it). Not part of
        Flower's Grid API; the strategies use it, when present, for the central evaluation (the
        user's code, which ``retry_ast_race`` guards as ``_execute`` guards the ClientApp)."""
        return self._pooled(retry_ast_race, fn, *args) if self.workers > 1 else None

    def wait_messages(self, message_ids: Iterable[str], timeout: float | None = None) -> None:
        """Block until the replies to ``message_ids`` are ready (or ``timeout`` seconds). Not part
        of Flower's Grid API; the client manager uses it, when present, instead of polling."""
        futures = [self._futures[m] for m in message_ids if m in self._futures]
        if futures:
            wait(futures, timeout=timeout)
        elif not any(m in self._pending or (self.batches and self.batches.holds(m)) for m in message_ids):
            # nothing of ours to wait for: do not spin
            time.sleep(0.001 if timeout is None else max(0.0, min(0.001, timeout)))

    # -- Grid API
    def set_run(self, run: FlowerRun) -> None:
        self._run = run
        set_server_identity(run.run_id)

    @property
    def run(self) -> FlowerRun:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.node_ids if n not in self.offline]

    def push_unread(self, messages: Iterable[Message]) -> Iterable[str]:
        """Not Flower's: ``push_messages`` for jobs the caller does not expect to pull (the virtual
        clock's manager: their client goes offline first, or they end after the budget). Each is
        computed only if pulled, alone (a batch of one): never ahead, in a worker process or a batch."""
        self._local.unread = True  # (this thread's pushes only: a federated evaluation may push beside it)
        try:
            return self.push_messages(messages)  # (a subclass's override sees them too)
        finally:
            self._local.unread = False

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids, unread = [], getattr(self._local, "unread", False)
        for msg in messages:
            if self._partition(msg.metadata.dst_node_id) is None:
                raise ValueError(f"unknown destination node {msg.metadata.dst_node_id}")
            mid = f"{self._next_id:016x}"
            self._next_id += 1
            set_message_id(msg, mid)
            if self.threaded:
                nid = msg.metadata.dst_node_id
                if nid not in self._executors:
                    self._executors[nid] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"node{nid}")
                self._futures[mid] = self._executors[nid].submit(self._execute, msg)
            elif self.ahead and not unread:
                self._futures[mid] = self._pooled(self._execute_in_order, msg)
            elif self.batches is None or not self.batches.push(mid, msg, alone=unread):
                self._pending[mid] = msg
            ids.append(mid)
        self.messages_pushed += len(ids)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = []
        if self.threaded or self.ahead:
            for mid in message_ids:
                fut = self._futures.get(mid)
                if fut is not None and fut.done():
                    del self._futures[mid]
                    replies.append(fut.result())
                elif mid in self._pending:  # (pushed unread: computed now)
                    replies.append(self._execute_in_order(self._pending.pop(mid)))
            return replies
        for mid in message_ids:
            msg = self._pending.pop(mid, None)
            if msg is not None:
                replies.append(self._execute(msg))
            elif self.batches is not None:
                rep = self.batches.reply(mid)
                if rep is not None:
                    replies.append(rep)
        return replies

    def discard_messages(self, message_ids: Iterable[str]) -> None:
        """Forget messages whose replies are no longer wanted (not part of Flower's Grid API;
        the client manager uses it, when present, for cancelled jobs)."""
        for mid in message_ids:
            self._pending.pop(mid, None)
            if self.batches is not None:
                self.batches.discard(mid)
            fut = self._futures.pop(mid, None)
            if fut is not None:
                fut.cancel()

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        if self.threaded or self.ahead:
            wait([self._futures[m] for m in ids if m in self._futures], timeout=timeout)
        return self.pull_messages(ids)

    # -- execution
    def _execute(self, msg: Message) -> Message:
        nid = msg.metadata.dst_node_id
        partition = self._partition(nid)
        ctx = self.context(nid, partition)
        if nid in self.offline:
            reply = Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="node unavailable"), reply_to=msg)
            set_message_id(reply, f"r{msg.metadata.message_id}")
            return reply
        try:
            reply = retry_ast_race(self.client_app, msg, ctx)
        except Exception as exc:  # noqa: BLE001 - surfaced to the server as Flower does
            reply = Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(exc)}:<'{exc}'>"),
                reply_to=msg,
            )
            set_message_id(reply, f"r{msg.metadata.message_id}")
            return self._forget_pristine(reply, ctx, partition)
        return self._finish(msg, reply, ctx, partition)

    def _finish(self, msg: Message, reply: Message | None, ctx: Context, partition: int | None = -1) -> Message:
        """A ClientApp's ``reply`` to ``msg`` as the Grid hands it over (None: compute it alone now)."""
        if reply is None:
            return self._execute(msg)
        why = mismatch(msg, reply)
        if why is not None:  # (Flower's SuperLink refuses such a reply; here its job fails at once)
            reply = unmatched_error(msg, reply, why)
        set_message_id(reply, f"r{msg.metadata.message_id}")
        return self._forget_pristine(reply, ctx, self._partition(ctx.node_id) if partition == -1 else partition)

    def _forget_pristine(self, reply: Message, ctx: Context, partition: int | None) -> Message:
        if len(self.node_ids) > KEEP_ALL_CONTEXTS and self._pristine(ctx, partition):
            self.contexts.pop(ctx.node_id, None)  # a fresh one is the same: memory grows with the jobs in flight, not N
        return reply

    def _pristine(self, ctx: Context, partition: int | None) -> bool:
        """Whether ``ctx`` equals the context :meth:`context` would make afresh for ``partition`` (the
        ClientApp kept nothing in its state and changed no config)."""
        if len(ctx.state) or ctx.run_config != self._run_config:
            return False
        return ctx.node_config == self._fresh_config(partition)
