"""SuperNodes that die mid-run and come back: which ones and when, and carrying that out.

A kill is a SIGKILL of the node's whole process group (a device that loses power: no deactivation,
the SuperLink notices only by the missing heartbeats). A revival starts the node again with the same
partition; in the insecure setup it registers as a new node, with ``--secure`` it keeps the node id
of its key, and then it must wait until the SuperLink has marked the old session offline.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

from .config import DeployConfig
from .deployment import LocalDeployment
from .output import NodeEvents, log

STATUS_EVERY = 2.0  # --secure: seconds between two ``flwr supernode ls`` for one node waiting to rejoin
SPARE_AT_MOST = 10.0  # --spare-replies: a reply still being sent after this many seconds is not waited for


@dataclass
class Kill:
    """One node's death and revival. Times in seconds since ``flwr run`` was started; the ``_wall``
    ones are ``time.time()``, the stamps of the nodes' logs."""

    node: int
    at: float  # when the kill is due
    killed_at: float | None = None
    revived_at: float | None = None
    killed_wall: float | None = None
    revived_wall: float | None = None
    waited_for_offline: bool = False  # --secure: the revival waited for the SuperLink's "offline"
    checked_at: float = -math.inf  # --secure: when the node's status was last asked for


def plan_kills(config: DeployConfig) -> tuple[list[Kill], int]:
    """The kills of a run, in time order, and the seed they were drawn with.

    The nodes are ``--kill-node``'s, or ``--kill-random K`` distinct ones; each dies at a time drawn
    uniformly from [``kill_after``, ``kill_after + kill_spread``] (all at ``kill_after`` without a
    spread). Without ``--kill-seed`` a seed is drawn, so that the run's report can name it.
    """
    seed = config.kill_seed if config.kill_seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    nodes = list(config.kill_nodes) or sorted(rng.sample(range(config.nodes), config.kill_random))
    kills = [Kill(i, config.kill_after + rng.uniform(0.0, config.kill_spread)) for i in nodes]
    return sorted(kills, key=lambda k: (k.at, k.node)), seed


class Reaper:
    """Kills the planned nodes when due and revives each ``revive_after`` seconds after its kill.

    ``spare_replies``: a kill that falls while the node is sending a reply waits until the reply is
    sent (unless the node has been sending for ``SPARE_AT_MOST`` seconds). Killed mid-upload, a
    reply's message is in the SuperLink without its objects, and Flower 1.42's ServerApp, pulling
    it, waits for them until the SuperLink drops the upload (``OBJECT_PUSH_SESSION_TTL_SECONDS``,
    180 s): the whole run stalls.
    """

    def __init__(self, kills: list[Kill], dep: LocalDeployment, revive_after: float | None,
                 spare_replies: bool = False) -> None:
        self.kills, self.dep, self.revive_after, self.spare_replies = kills, dep, revive_after, spare_replies

    def step(self, elapsed: float) -> None:
        """Carry out what is due ``elapsed`` seconds into the run."""
        for k in self.kills:
            if k.killed_at is None and elapsed >= k.at and not self._sending(k):
                self.dep.kill_node(k.node)
                k.killed_at, k.killed_wall = elapsed, time.time()
                log(f"SIGKILLed SuperNode {k.node} at {elapsed:.1f} s into the run")
            elif k.killed_at is not None and k.revived_at is None and self.revive_after is not None \
                    and elapsed - k.killed_at >= self.revive_after and self._may_rejoin(k, elapsed):
                proc = self.dep.start_node(k.node)
                k.revived_at, k.revived_wall = elapsed, time.time()
                log(f"restarted SuperNode {k.node} at {elapsed:.1f} s into the run (pid {proc.pid})")

    def _sending(self, k: Kill) -> bool:
        """Whether the kill of ``k.node`` waits for the reply the node is sending (``spare_replies``)."""
        if not self.spare_replies:
            return False
        now = time.time()
        since = self.dep.events.sending_since(f"node{k.node}", now)
        return since is not None and now - since < SPARE_AT_MOST

    def _may_rejoin(self, k: Kill, elapsed: float) -> bool:
        """Whether node ``k.node`` may be restarted. With ``--secure`` its node id belongs to its
        registered key, and the SuperLink refuses to activate a node it still lists as online
        (``[code: 2004]``): wait until it has marked it offline (≤ 2 × 30 s after its last
        heartbeat). Asked at most every ``STATUS_EVERY`` seconds per node."""
        if not self.dep.config.secure:
            return True
        if elapsed - k.checked_at < STATUS_EVERY:
            return False
        k.checked_at = elapsed
        status = self.dep.node_status(k.node)
        if status == "online" and not k.waited_for_offline:
            k.waited_for_offline = True
            log(f"SuperNode {k.node} is still online at the SuperLink; waiting for it to be marked offline "
                "before restarting it with the same key")
        return status == "offline"

    def report(self, events: NodeEvents) -> list[dict[str, Any]]:
        """Per kill: the node, when it was due, killed and revived (seconds into the run), whether
        it was killed while sending a reply, and the train replies it sent before its kill and
        after its revival (from its log)."""
        out = []
        for k in self.kills:
            name = f"node{k.node}"
            replies = events.reply_times(name)
            killed = math.inf if k.killed_wall is None else k.killed_wall
            revived = math.inf if k.revived_wall is None else k.revived_wall
            after = [t for t in replies if t >= revived]
            row = {"node": k.node, "planned_at": round(k.at, 2), "killed_at": _round(k.killed_at),
                   "revived_at": _round(k.revived_at),
                   "killed_while_sending": k.killed_wall is not None and events.sending_since(name, killed) is not None,
                   "replies_before_kill": sum(1 for t in replies if t < killed),
                   "replies_after_revival": len(after),
                   "first_reply_after_revival_at": _round(after[0] - revived + k.revived_at) if after else None}
            if self.dep.config.secure:
                row["revive_waited_for_offline"] = k.waited_for_offline
            out.append(row)
        return out


def _round(t: float | None) -> float | None:
    return None if t is None else round(t, 2)
