"""Which node is which worker: numbering the nodes at the start and, on the wall clock, following
nodes that leave and come back (a restarted SuperNode has a new node id).

With the partition query (``fl_rescaled.add_partition_query`` in the ClientApp) workers are numbered
by ``partition-id`` and a node that appears says which worker it is. Without it, workers are the
nodes in ascending node-id order, and a node that appears takes the place of a worker whose node is
gone (lowest index first).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from flwr.app import Message
from flwr.serverapp import Grid

from fl_rescaled.errors import client_error_text
from fl_rescaled.messages import hello_message, parse_hello

from .books import Books
from .transport import Transport

log = logging.getLogger("flwr.fl_rescaled")


class Membership:
    def __init__(self, grid: Grid, transport: Transport, *, ttl: float, node_refresh: float = 2.0) -> None:
        self.grid = grid
        self.transport = transport
        self.ttl = ttl
        self.node_refresh = node_refresh
        self.partition_query = False
        self.worker_of_node: dict[int, int] = {}
        self.ignored: set[int] = set()  # nodes that are not workers of this run
        self.joined: list[int] = []  # workers that (re)appeared and wait for a job
        self.books: Books | None = None
        self.on_online: Callable[[int, bool], None] = lambda worker, online: None
        self._next_refresh = 0.0
        transport.on_hello = self.hello_answered

    def __getstate__(self) -> dict:  # (a checkpoint: no Grid, no callback)
        return {**self.__dict__, "grid": None, "on_online": None}

    # ------------------------------------------------------------------ the start
    def connect(self, num_workers: int | None, timeout: float, partition_query: bool) -> list[int]:
        """Wait for the nodes; return the node ids in worker order."""
        deadline = time.monotonic() + timeout
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
        self.worker_of_node = {n: i for i, n in enumerate(order)}
        self.ignored = set(nodes) - set(order)
        return order

    def rediscover(self, timeout: float) -> None:
        """A restarted server (wall clock): find the nodes again and give each worker its node (by
        partition with the partition query, else in node-id order); workers without one are offline."""
        assert self.books is not None
        deadline = time.monotonic() + timeout
        nodes = sorted(int(n) for n in self.grid.get_node_ids())
        order = self._order_by_partition(nodes, deadline) if self.partition_query else nodes
        self.worker_of_node = {}
        for i, book in enumerate(self.books.workers):
            if i < len(order):
                book.node_id = order[i]
                self.worker_of_node[order[i]] = i
            self.set_online(i, i < len(order))
        self.ignored = set(nodes) - set(self.worker_of_node)
        self._next_refresh = 0.0

    def _order_by_partition(self, nodes: list[int], deadline: float) -> list[int]:
        ttl = max(1.0, deadline - time.monotonic())
        ids = list(self.grid.push_messages([hello_message(n, ttl) for n in nodes]))
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
                node = node_of.get(mid, rep.metadata.src_node_id)
                pid = parse_hello(rep)
                if pid is None:
                    failed[node] = str(rep.error.reason) if rep.has_error() else "no partition-id in the answer"
                else:
                    partition[node] = pid
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

    # ------------------------------------------------------------------ the wall clock
    def online_workers(self) -> list[int]:
        assert self.books is not None
        return [i for i, b in enumerate(self.books.workers) if b.online]

    def set_online(self, worker: int, online: bool) -> None:
        assert self.books is not None
        book = self.books.workers[worker]
        if book.online != online:
            book.online = online
            self.on_online(worker, online)

    def due(self) -> bool:
        return time.monotonic() >= self._next_refresh

    def refresh(self) -> None:
        """Look for nodes that left or appeared (a new or restarted SuperNode) and place them."""
        assert self.books is not None
        self._next_refresh = time.monotonic() + self.node_refresh
        try:
            current = {int(n) for n in self.grid.get_node_ids()}
        except Exception as exc:  # noqa: BLE001 - a transient transport error: try later
            log.warning("could not list nodes: %s", exc)
            return
        pending_hello = set(self.transport.hello_pending.values())
        for i, book in enumerate(self.books.workers):
            if book.online and book.node_id not in current and not book.pending:
                self.set_online(i, False)
                log.warning("worker %d (node %d) left", i, book.node_id)
            elif not book.online and book.node_id in current:
                if not self.partition_query:  # (no query to probe it with) listed again: back
                    self.rejoin(i, book.node_id)
                # Listed is not alive: a SIGKILLed node stays listed until its heartbeat times out
                # (~60 s). Probe it; the answer marks it back.
                elif book.node_id not in pending_hello:
                    self._probe([book.node_id])
        known = set(self.worker_of_node) | set(self.transport.hello_pending.values()) | self.ignored
        new = sorted(current - known)
        if self.partition_query:
            self._probe(new)
            return
        gone = [i for i, b in enumerate(self.books.workers) if not b.online and b.node_id not in current]
        for node in new:
            if not gone:
                self.ignored.add(node)
                log.warning("node %d appeared; no worker is missing, so it gets no jobs", node)
                continue
            self.rejoin(gone.pop(0), node)

    def _probe(self, nodes: list[int]) -> None:
        """Ask ``nodes`` who they are; ``hello_answered`` handles the answers as they arrive."""
        if nodes:
            self.transport.push_hellos([hello_message(n, min(self.ttl, 60.0)) for n in nodes], nodes)

    def hello_answered(self, node: int, rep: Message) -> None:
        assert self.books is not None
        worker = parse_hello(rep)
        if worker is None:
            log.warning("node %d did not answer the partition query", node)
            return
        if not 0 <= worker < len(self.books.workers):
            self.ignored.add(node)
            log.warning("node %d holds partition %d, outside this run's %d workers", node, worker,
                        len(self.books.workers))
            return
        self.rejoin(worker, node)

    def rejoin(self, worker: int, node: int) -> None:
        """Worker ``worker`` is on node ``node`` (again): it is online and waits for a job."""
        assert self.books is not None
        book = self.books.workers[worker]
        old = book.node_id
        self.worker_of_node.pop(old, None)
        self.worker_of_node[node] = worker
        book.node_id = node
        if not book.online or old != node:
            self.set_online(worker, True)
            self.joined.append(worker)
            log.warning("worker %d (re)joined on node %d", worker, node)

    def pop_joined(self) -> list[int]:
        joined, self.joined = self.joined, []
        return joined
