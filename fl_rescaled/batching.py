"""Batched ClientApps: one call that answers many jobs in flight, for the in-process Grid.

A ``BatchedClientApp`` is an ordinary Flower ``ClientApp`` (Flower's engine and a deployment call
it one message at a time, as any other) that also registers a *batch entry*:

- ``key(msg)``: a hashable that says which messages may be answered in one call (equal keys), or
  None for a message that must go one by one;
- ``fn(msgs, contexts)``: the replies to ``msgs`` (same order), each the reply the app's own
  ``train``/``evaluate`` function would give to that message in that context, up to float rounding;
- ``chunk(msg)`` (optional): at most this many messages per call (None: all in one call).

The in-process Grid (``fl_rescaled.grid``) computes a job's reply only when the strategy needs it,
and then answers every pending job of the same key at once (``plan_chunks`` cuts them into calls of
a size that depends only on their number, never on ``--workers``, so the bits of every reply are the
same for any number of threads). A ClientApp without a batch entry, or one with Flower mods (which
wrap single calls only), is run one message at a time as before.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

BatchKey = Callable[[Message], Hashable | None]
BatchFn = Callable[[Sequence[Message], Sequence[Context]], list[Message]]


class Launched(Protocol):
    """A job started elsewhere (another process): its reply when pulled, or forgotten."""

    def reply(self) -> Message: ...

    def cancel(self) -> None: ...


@dataclass(frozen=True)
class BatchEntry:
    """What a ``BatchedClientApp`` offers the Grid (see the module docstring)."""

    key: BatchKey
    fn: BatchFn
    chunk: Callable[[Message], int | None] | int | None = None
    #: ``launch(msg, context)``: start one job now and return a ``Launched`` (None: not this one). The
    #: Grid calls it when the job is pushed, with ``workers`` ≥ 2, and collects the reply when pulled.
    launch: Callable[[Message, Context], Launched | None] | None = None

    def chunk_size(self, msg: Message) -> int | None:
        """At most this many messages per call for a batch that contains ``msg`` (None: no limit)."""
        size = self.chunk(msg) if callable(self.chunk) else self.chunk
        return None if size is None else max(1, int(size))


class BatchedClientApp(ClientApp):
    """A Flower ``ClientApp`` that can also answer many messages in one call.

    Register the single-message functions as usual (``@app.train()``, ``@app.evaluate()``), then the
    batch entry with ``@app.batch(key=...)``::

        app = BatchedClientApp()

        @app.train()
        def train(msg, context): ...

        @app.batch(key=lambda msg: "train" if msg.metadata.message_type == "train" else None)
        def train_many(msgs, contexts): ...

    Flower's runtimes never see the batch entry; the in-process Grid uses it (``batch_entry``). A call
    that raises, or returns another number of replies, is redone one message at a time through the
    single-message functions (each failing job then gets its own error reply): a batch entry should
    write to a context's state only once its replies are made, or the redone jobs see it twice.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_entry: BatchEntry | None = None

    def batch(self, key: BatchKey, chunk: Callable[[Message], int | None] | int | None = None,
              launch: Callable[[Message, Context], Launched | None] | None = None
              ) -> Callable[[BatchFn], BatchFn]:
        """Register ``fn(msgs, contexts) -> replies`` as the batch entry (a decorator).

        Parameters
        ----------
        key : callable
            ``key(msg)``: equal keys may share a call; None sends the message one by one.
        chunk : int or callable, optional
            At most this many messages per call (or ``chunk(msg)`` for the batch of ``msg``).
        launch : callable, optional
            ``launch(msg, context)``: start the job elsewhere when it is pushed and return a
            ``Launched`` whose ``reply()`` is the reply ``fn`` would give (the same bits), or None to
            leave the job to ``fn``. Used by the in-process Grid with ``workers`` ≥ 2 only.
        """
        def register(fn: BatchFn) -> BatchFn:
            self.batch_entry = BatchEntry(key, fn, chunk, launch)
            return fn

        return register


def batch_entry(app: ClientApp) -> BatchEntry | None:
    """The batch entry ``app`` offers the Grid, or None (not a ``BatchedClientApp``, none registered,
    or Flower mods, which wrap one call per message, are attached)."""
    entry = getattr(app, "batch_entry", None)
    if not isinstance(entry, BatchEntry) or getattr(app, "_mods", None):
        return None
    return entry


def plan_chunks(n: int, chunk: int | None) -> list[slice]:
    """Cut ``n`` messages into ⌈n / chunk⌉ consecutive calls of near-equal sizes (a function of ``n``
    and ``chunk`` only)."""
    if n <= 0:
        return []
    parts = 1 if not chunk else -(-n // chunk)
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append(slice(start, stop))
        start = stop
    return out
