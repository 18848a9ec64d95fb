"""What the client manager asks of a clock: the ``CompletionSource`` protocol.

A run's clock decides when jobs finish, who is online, what the stepsize rules read as each
worker's τ, what a failed or cancelled job cost, how long a failing client is set aside, and what
of all that a checkpoint keeps. Each clock has one source that decides all of it:
``VirtualSource`` (``virtual.py``: simulated time, a heap of finishing times, availability models)
and ``WallSource`` (``wall.py``: replies in arrival order, TTLs, τ estimated online). The manager
picks one when it is built and from then on only calls the methods below; it makes no decision of
its own that depends on the clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from flwr.app import Message

from fl_rescaled.algorithm import Job
from fl_rescaled.stepsizes import TauTable

from .selection import Population


class CompletionSource(Protocol):
    """A clock's completion source (see the module docstring)."""

    #: Whether the clock is simulated (read by reports and the ``Run`` protocol; never branched on
    #: by the manager or the driver).
    virtual: bool
    #: Slots that waited for a client to come back and can be filled now (0 on the wall clock).
    woken: int

    @property
    def periods(self) -> TauTable:
        """What the stepsize rules read as τ_i: each worker's mean time between deliveries p_i."""

    @property
    def compute_times(self) -> TauTable:
        """Each worker's mean compute time τ_i (``periods`` itself when every worker is always busy)."""

    # -- workers
    def tables(self, num_workers: int, weights: Sequence[float] | None) -> None:
        """Make the τ tables for ``num_workers`` workers (target ``weights``, if any)."""

    def populate(self, population: Population, weights: Sequence[float] | None) -> None:
        """The population is known (N workers, C slots): adapt the tables and the first events."""

    def is_online(self, worker: int) -> bool:
        """Whether ``worker`` can take a job now (on the roster, and online)."""

    def online_mask(self, workers: np.ndarray) -> np.ndarray:
        """``is_online`` for many workers at once."""

    def online_workers(self) -> list[int]:
        """The workers online now."""

    def all_online(self) -> bool:
        """Whether every worker is online for the whole run."""

    def aside_seconds(self, strikes: int) -> float:
        """How long a client whose last ``strikes`` jobs failed is set aside (inf: for good)."""

    def start(self) -> None:
        """The run starts (its strategy's ``start()`` was called; before the nodes are waited for)."""

    # -- jobs
    def dispatched(self, job: Job) -> bool:
        """``job`` is about to be pushed: set its start (and, when simulated, finishing) time. False
        when the source knows now that its reply will not be read (``Transport.push_job``'s ``read``)."""

    def no_worker(self, population: Population, after: int | None) -> None:
        """No worker could take the job that follows ``after``'s: arrange for its slot to be filled."""

    def take_woken(self) -> int:
        """The slots woken since the last call (and reset the count)."""

    def next(self, budget: float) -> tuple[Job, Message | None, float, str | None] | None:
        """The next job to end, its reply (None: lost), its time and why it was lost; None past
        ``budget`` or when workers came back (the caller gives them work, then asks again)."""

    def accepted(self, job: Job, metrics: dict[str, Any], t: float, count: int) -> float:
        """An accepted reply at ``t`` (its worker's ``count``-th): update the estimates; its compute time."""

    def failed(self, job: Job, t: float) -> float:
        """The compute time booked for a job that failed or was lost at ``t``."""

    def work(self, job: Job) -> float:
        """The compute time of a finished job (booked as wasted when its reply is not used)."""

    def cancel(self, job: Job) -> float | None:
        """Stop ``job``; the compute time it used (None: not known yet)."""

    def cancelled_reply(self, job: Job, rep: Message) -> float:
        """The compute time of a cancelled job whose reply came anyway."""

    def node_gone(self, job: Job) -> None:
        """``job`` failed because its node is gone."""

    def busy(self, done: np.ndarray, t: float) -> np.ndarray:
        """Each worker's compute time up to ``t`` (``done``: that of its finished jobs)."""

    # -- the checkpoint
    def snapshot(self) -> dict[str, Any]:
        """This source's part of the manager's state: ``{"virtual": ...}`` or ``{"wall": ...}``."""

    def restore(self, saved: Any, population: Population) -> tuple[list[Job], list[int]]:
        """Go on from the manager's ``saved`` state (a ``ManagerState``: this source's own part, and
        the jobs in flight with their models), checked against this source's invariants first
        (ValueError, one line, when no such source could have written it). Returns the jobs in
        flight that are lost, and the workers that need jobs now."""
