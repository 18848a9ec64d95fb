"""What the strategies need of a Grid beyond Flower's API, declared once, and the helpers around it.

Flower's ``Grid`` pushes messages, pulls the replies that are ready and lists the nodes. An
asynchronous run can use a little more, when the Grid offers it (``AsyncGrid``):

- ``virtual_time``: replies are computed when pulled (an in-process Grid), so the run can use the
  virtual clock;
- ``partition_order``: the node ids ascend with the nodes' ``partition-id`` (a Grid that numbers its
  nodes so), so workers can be numbered by partition without asking every node;
- ``node_config(node_id)``: a node's config (its ``tau`` on the virtual clock);
- ``wait_messages(ids, timeout)``: block until replies are ready, instead of polling;
- ``discard_messages(ids)``: forget messages whose replies are no longer wanted (cancelled jobs);
- ``submit(fn, *args)``: run ``fn`` on the Grid's thread pool (the central evaluation), or None;
- ``push_unread(messages)``, looked up where used (``Transport.push_job``; ``push_messages`` without
  it): push jobs the virtual clock knows it will not read, to be computed only if pulled after all.

``InProcessGrid`` implements all of it. ``as_async_grid`` wraps any other Grid (Flower's own
runtimes) in ``FlowerGrid``, which adds the defaults: the wall clock, empty node configs, a sleep
of ``poll_interval`` for a wait, nothing to discard, no pool. ``collect_replies`` is the one loop
that waits for a set of replies (jobs on the virtual clock, the partition query, federated
evaluation). ``set_message_id`` is the one place that writes Flower's private message metadata.

Nothing waits in silence: ``Quiet`` times how long no awaited reply has come, and every
``WAIT_NOTICE_EVERY`` seconds of it the waiting loop (``collect_replies``, and the wall clock's
``WallSource.next``) logs a warning: what it waits for, since when, and when its deadline (a job's
TTL, the evaluation's timeout) gives up on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from flwr.app import Message
from flwr.serverapp import Grid

log = logging.getLogger("flwr.fl_rescaled")

#: While replies are awaited and none comes, the log says so every this many seconds (read when a
#: silence starts: a test may set it lower).
WAIT_NOTICE_EVERY = 60.0


@runtime_checkable
class AsyncGrid(Protocol):
    """A Grid with the extras of the module docstring (``InProcessGrid``, or ``FlowerGrid`` around Flower's)."""

    virtual_time: bool
    partition_order: bool

    def get_node_ids(self) -> Iterable[int]: ...

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]: ...

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]: ...

    def node_config(self, node_id: int) -> dict[str, Any]: ...

    def wait_messages(self, message_ids: Iterable[str], timeout: float | None = None) -> None: ...

    def discard_messages(self, message_ids: Iterable[str]) -> None: ...

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future | None: ...


class FlowerGrid:
    """Flower's Grid (Simulation Engine, deployment) with the ``AsyncGrid`` defaults."""

    virtual_time = False
    partition_order = False

    def __init__(self, grid: Grid, poll_interval: float = 0.002) -> None:
        self.grid = grid
        self.poll_interval = poll_interval

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def node_config(self, node_id: int) -> dict[str, Any]:
        del node_id  # (Flower's ServerApp cannot read a node's config)
        return {}

    def wait_messages(self, message_ids: Iterable[str], timeout: float | None = None) -> None:
        del message_ids
        time.sleep(self.poll_interval if timeout is None else max(0.0, min(self.poll_interval, timeout)))

    def discard_messages(self, message_ids: Iterable[str]) -> None:
        del message_ids  # a remote computation cannot be stopped; its reply is dropped on arrival

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future | None:
        return None


def as_async_grid(grid: Any, poll_interval: float = 0.002) -> AsyncGrid:
    """``grid`` itself when it is an ``AsyncGrid``, else Flower's Grid wrapped in ``FlowerGrid``."""
    if isinstance(grid, AsyncGrid):
        return grid
    return FlowerGrid(grid, poll_interval)


class Quiet:
    """How long no awaited reply has come (``since``), and whether it is time to say so: ``due``
    is True once per ``WAIT_NOTICE_EVERY`` seconds of silence."""

    def __init__(self, now: float | None = None) -> None:
        self.heard(now)

    def heard(self, now: float | None = None) -> None:
        """A reply came (or a wait starts): the silence starts now."""
        self.since = time.monotonic() if now is None else now
        self.every = WAIT_NOTICE_EVERY
        self.next_at = self.since + self.every

    def due(self, now: float) -> bool:
        if now < self.next_at:
            return False
        self.next_at = now + self.every
        return True

    def left(self, now: float) -> float:
        """Seconds until the next notice is due."""
        return max(0.0, self.next_at - now)


def seconds(x: float) -> str:
    """A duration for the log: whole seconds from 10 s, else two significant digits."""
    return f"{x:.0f} s" if x >= 10 else f"{x:.2g} s"


def collect_replies(grid: AsyncGrid, message_ids: Iterable[str], deadline: float,
                    on_reply: Callable[[Message], bool | None], *, what: str = "replies",
                    at_deadline: str = "given up") -> set[str]:
    """Pull the replies to ``message_ids`` as they come, handing each to ``on_reply``, until all
    have come or ``time.monotonic()`` passes ``deadline``; returns the ids still unanswered.

    ``on_reply`` returns False for a reply that does not answer its message (a stray: another
    node's, say); that message is still awaited. Every ``WAIT_NOTICE_EVERY`` seconds in which no
    reply came, a warning says how many of ``what`` are missing, since when, and in how long they
    are ``at_deadline``.
    """
    pending = set(message_ids)
    total = len(pending)
    quiet = Quiet()
    while pending:
        before = len(pending)
        got = list(grid.pull_messages(list(pending)))
        for rep in got:
            if on_reply(rep) is not False:
                pending.discard(rep.metadata.reply_to_message_id)
        now = time.monotonic()
        remaining = deadline - now
        if not pending or remaining <= 0:
            break
        if len(pending) < before:
            quiet.heard(now)
        elif quiet.due(now):
            log.warning("still waiting for %s: %d of %d missing, none came for %s; %s in %s", what, len(pending),
                        total, seconds(now - quiet.since), at_deadline, seconds(remaining))
        if not got:
            grid.wait_messages(list(pending), timeout=min(remaining, quiet.left(now)))
    return pending


def set_message_id(message: Message, message_id: str) -> None:
    """Give ``message`` its id, as Flower's runtimes do when they store it (Flower's metadata has
    no public setter: an in-process Grid must write the private field)."""
    message.metadata.__dict__["_message_id"] = message_id
