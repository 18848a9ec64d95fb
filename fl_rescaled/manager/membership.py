"""Which node is which worker: numbering the nodes at the start and, on the wall clock, following
nodes that leave and come back (a restarted SuperNode has a new node id).

With the partition query (``fl_rescaled.add_partition_query`` in the ClientApp) workers are numbered
by ``partition-id`` and a node that appears says which worker it is. Without it, workers are the
nodes in ascending node-id order, and a node that appears takes the place of a worker whose node is
gone (lowest index first). ``Roster`` is what a checkpoint keeps of it.

A worker whose client keeps failing is set aside (``set_aside``): it is offline for the strategy
until ``aside_until`` (wall-clock seconds, ``time.monotonic``; for ever on the virtual clock), or
until it comes back on a new node (a restarted SuperNode).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Message

from fl_rescaled.errors import client_error_text, one_line
from fl_rescaled.grid_api import AsyncGrid, collect_replies
from fl_rescaled.matching import from_node
from fl_rescaled.messages import hello_message, parse_hello

from .transport import Transport

log = logging.getLogger("flwr.fl_rescaled")


@dataclass
class Roster:
    """Workers and their nodes: the node each worker is on, whether it is online (wall clock)."""

    node_ids: list[int] = field(default_factory=list)
    online: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    partition_query: bool = False
    ignored: list[int] = field(default_factory=list)  # nodes that are not workers of this run

    def check(self) -> None:
        if self.online.dtype != bool or self.online.shape != (len(self.node_ids),):
            raise ValueError("roster: one online flag per worker")
        if len(set(self.node_ids)) != len(self.node_ids):
            raise ValueError("roster: two workers on one node")


class Membership:
    """Which node is which worker: the roster, nodes that leave and come back, workers set aside."""

    def __init__(self, grid: AsyncGrid, transport: Transport, *, ttl: float, node_refresh: float = 2.0) -> None:
        self.grid = grid
        self.transport = transport
        self.ttl = ttl
        self.node_refresh = node_refresh
        self.roster = Roster()
        self.aside_until = np.zeros(0)  # per worker: set aside until then (time.monotonic(); inf: for good)
        self._worker_of_node: dict[int, int] | None = {}
        self.joined: list[int] = []  # workers that (re)appeared and wait for a job
        self.has_jobs: Callable[[int], bool] = lambda worker: False  # (the books: a job in flight)
        self.on_online: Callable[[int, bool], None] = lambda worker, online: None
        self._next_refresh = 0.0
        transport.on_hello = self.hello_answered

    def name(self, worker: int) -> str:
        """One name for a client in every log line: its partition when the workers are numbered by
        partition, else its node (workers are then the nodes in node-id order)."""
        if self.roster.partition_query:
            return f"partition {worker}"
        return f"node {self.roster.node_ids[worker]}"

    def use(self, roster: Roster) -> None:
        """Take ``roster`` (a fresh one, or a checkpoint's) as the workers' nodes."""
        self.roster = roster
        self.aside_until = np.zeros(len(roster.node_ids))  # (a resumed wall-clock run tries every node again)
        self._worker_of_node = None  # (made when a node comes or goes: the wall clock)

    @property
    def worker_of_node(self) -> dict[int, int]:
        if self._worker_of_node is None:
            self._worker_of_node = {n: i for i, n in enumerate(self.roster.node_ids)}
        return self._worker_of_node

    # ------------------------------------------------------------------ the start
    def connect(self, num_workers: int | None, timeout: float, partition_query: bool, min_nodes: int = 1) -> list[int]:
        """Wait for the nodes (``num_workers`` of them, or at least ``min_nodes``); number them as
        workers; return the node ids in worker order."""
        deadline = time.monotonic() + timeout
        need = max(min_nodes, num_workers or 1)
        while True:
            nodes = sorted(map(int, self.grid.get_node_ids()))
            if len(nodes) >= need:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(nodes)} of {need} nodes connected within {timeout:g} s")
            time.sleep(0.1)
        order = self._order_by_partition(nodes, deadline) if partition_query else nodes
        ignored: list[int] = []
        if num_workers is not None and num_workers < len(order):
            order = order[:num_workers]
            ignored = sorted(set(nodes) - set(order))
        self.use(Roster(order, np.ones(len(order), bool), partition_query, ignored))
        return list(order)

    def rediscover(self, timeout: float) -> None:
        """A restarted server (wall clock): find the nodes again and give each worker its node (by
        partition with the partition query, else in node-id order); workers without one are offline."""
        deadline = time.monotonic() + timeout
        nodes = sorted(map(int, self.grid.get_node_ids()))
        order = self._order_by_partition(nodes, deadline) if self.roster.partition_query else nodes
        roster = self.roster
        for i in range(len(roster.node_ids)):
            if i < len(order):
                roster.node_ids[i] = order[i]
            self.set_online(i, i < len(order))
        self.use(roster)
        roster.ignored = sorted(set(nodes) - set(self.worker_of_node))
        self._next_refresh = 0.0

    def _order_by_partition(self, nodes: list[int], deadline: float) -> list[int]:
        if self.grid.partition_order:  # (the Grid numbers its nodes in partition order: nothing to ask)
            return sorted(nodes)
        ttl = max(1.0, deadline - time.monotonic())
        ids = list(self.grid.push_messages([hello_message(n, ttl) for n in nodes]))
        node_of = dict(zip(ids, nodes))
        partition: dict[int, int] = {}
        failed: dict[int, str] = {}

        def answered(rep: Message) -> bool:
            node = node_of.get(rep.metadata.reply_to_message_id)
            if node is None or not from_node(rep, node):  # (not the answer of the node asked: still awaited)
                log.warning("ignored an answer to the partition query from node %s (the query went to node %s)",
                            rep.metadata.src_node_id, node)
                return False
            pid = parse_hello(rep)
            if pid is None:
                failed[node] = str(rep.error.reason) if rep.has_error() else "no partition-id in the answer"
            else:
                partition[node] = pid
            return True

        pending = collect_replies(self.grid, ids, deadline, answered, what="answers to the partition query",
                                  at_deadline="the run fails")
        if pending or failed:
            why = (f"{len(pending)} node(s) did not answer within the timeout" if pending
                   else f"node {next(iter(failed))} answered: {client_error_text(next(iter(failed.values())))}")
            raise RuntimeError(
                "this run numbers its workers by partition (per-partition taus, weights or worker "
                f"config), but the partition query failed: {why}. Add the query to your ClientApp with "
                "`fl_rescaled.add_partition_query(app)`, or give the settings in node-id order without it.")
        return self._in_partition_order(nodes, partition)

    @staticmethod
    def _in_partition_order(nodes: list[int], partition: dict[int, int]) -> list[int]:
        order = sorted(nodes, key=lambda n: partition[n])
        if [partition[n] for n in order] != list(range(len(nodes))):
            pids = sorted(partition[n] for n in nodes)
            raise RuntimeError(f"the nodes hold partitions {pids[:20]}{'...' if len(pids) > 20 else ''}; expected "
                               f"0..{len(nodes) - 1} once each")
        return order

    # ------------------------------------------------------------------ the wall clock
    def online_workers(self) -> list[int]:
        return np.flatnonzero(self.roster.online).tolist()

    def set_online(self, worker: int, online: bool) -> None:
        if bool(self.roster.online[worker]) != online:
            self.roster.online[worker] = online
            self.on_online(worker, online)

    def set_aside(self, worker: int, why: str, seconds: float) -> None:
        """Treat ``worker`` as a node that left (no new jobs, not waited for by rounds, out of the τ
        statistics) because of ``why``, for ``seconds`` (inf: for good): on the wall clock it is taken
        back when its node is listed after that, or at once on a new node; one warning line says so."""
        self.aside_until[worker] = time.monotonic() + seconds
        self.set_online(worker, False)
        log.warning("%s set aside: %s", self.name(worker), one_line(why, 600))

    def is_aside(self, worker: int) -> bool:
        return bool(self.aside_until[worker] > time.monotonic())

    def aside_mask(self) -> np.ndarray:
        return self.aside_until > time.monotonic()

    def due(self) -> bool:
        return time.monotonic() >= self._next_refresh

    def refresh(self) -> None:
        """Look for nodes that left or appeared (a new or restarted SuperNode) and place them."""
        roster = self.roster
        self._next_refresh = time.monotonic() + self.node_refresh
        try:
            current = {int(n) for n in self.grid.get_node_ids()}
        except Exception as exc:  # noqa: BLE001 - a transient transport error: try later
            log.warning("could not list nodes: %s", exc)
            return
        pending_hello = set(self.transport.hello_pending.values())
        roster.ignored = [n for n in roster.ignored if n in current]  # (nodes that come and go: no pile)
        now = time.monotonic()
        for i, node in enumerate(roster.node_ids):
            if roster.online[i] and node not in current and not self.has_jobs(i):
                self.set_online(i, False)
                log.warning("%s left", self.name(i))
            elif not roster.online[i] and node in current and self.aside_until[i] <= now:
                if not roster.partition_query:  # (no query to probe it with) listed again: back
                    self.rejoin(i, node)
                # Listed is not alive: a SIGKILLed node stays listed until its heartbeat times out
                # (~60 s). Probe it; the answer marks it back.
                elif node not in pending_hello:
                    self._probe([node])
        known = set(self.worker_of_node) | pending_hello | set(roster.ignored)
        new = sorted(current - known)
        if roster.partition_query:
            self._probe(new)
            return
        gone = [i for i, node in enumerate(roster.node_ids) if not roster.online[i] and node not in current]
        for node in new:
            if not gone:
                roster.ignored.append(node)
                log.warning("node %d appeared; no worker is missing, so it gets no jobs", node)
                continue
            self.rejoin(gone.pop(0), node)

    def _probe(self, nodes: list[int]) -> None:
        """Ask ``nodes`` who they are; ``hello_answered`` handles the answers as they arrive."""
        if nodes:
            self.transport.push_hellos([hello_message(n, min(self.ttl, 60.0)) for n in nodes], nodes)

    def hello_answered(self, node: int, rep: Message) -> None:
        worker = parse_hello(rep)
        if worker is None:
            log.warning("node %d did not answer the partition query", node)
            return
        if not 0 <= worker < len(self.roster.node_ids):
            self.roster.ignored.append(node)
            log.warning("node %d holds partition %d, outside this run's %d workers", node, worker,
                        len(self.roster.node_ids))
            return
        self.rejoin(worker, node)

    def rejoin(self, worker: int, node: int) -> None:
        """Worker ``worker`` is on node ``node`` (again): it is online and waits for a job."""
        roster = self.roster
        old = roster.node_ids[worker]
        if old == node and self.is_aside(worker):  # (set aside: back after its time, or on a new node)
            return
        self.aside_until[worker] = 0.0
        self.worker_of_node.pop(old, None)
        self.worker_of_node[node] = worker
        roster.node_ids[worker] = node
        if not roster.online[worker] or old != node:
            self.set_online(worker, True)
            self.joined.append(worker)
            log.warning("%s (re)joined%s", self.name(worker),
                        f" on node {node}" if self.roster.partition_query else "")

    def pop_joined(self) -> list[int]:
        """The workers that came back and wait for a job (not one set aside meanwhile: the virtual
        clock's availability may bring one back)."""
        joined, self.joined = self.joined, []
        return [w for w in joined if self.roster.online[w]]
