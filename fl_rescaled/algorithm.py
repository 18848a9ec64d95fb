"""The contract between an algorithm and the run it is part of: the ``Run`` protocol.

A strategy (``fl_rescaled.strategies``) is an algorithm: it reacts to one completion at a time and
acts on the run only through these calls. The driver (``fl_rescaled.driver``) implements them on
the real run (the model, the client manager, the books); ``tests/scripted.py`` implements them with
recorded lists, so an algorithm can be tested alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord

from .stepsizes import TauTable


@dataclass
class Job:
    """One job: the model version it carries, where it went, and (virtual clock) when it runs.

    ``model`` (the encoded model, shared by every job of the same version) is not part of the
    job's record in a checkpoint: the run's state keeps each version's model once.
    """

    job_id: int
    worker: int
    version: int
    seq: int  # this worker's job number (0, 1, 2, ...): seeds the client's randomness
    dispatch_time: float
    start_time: float = math.nan
    finish_time: float = math.nan  # virtual clock only
    message_id: str = ""
    pushed_at: float = 0.0  # wall-clock seconds (time.monotonic) of this process
    node_id: int = 0  # the node it was sent to (a worker's node id changes if its SuperNode restarts)
    config: dict[str, Any] = field(default_factory=dict)  # the config it was sent with (to send it again)
    model: ArrayRecord | None = field(default=None, metadata={"transient": True})


@dataclass
class Completion:
    """A finished job as the strategy sees it: its update (a direction g), or why there is none."""

    job: Job
    time: float
    delay: int  # δ = k − v: server updates applied since the job's model was sent
    update: np.ndarray | None = None  # a direction g (flat): the server steps x ← x − γ g
    metrics: dict[str, Any] = field(default_factory=dict)
    carried: dict[str, np.ndarray] = field(default_factory=dict)  # the reply's non-float arrays
    rejected: str | None = None  # reason when the reply must not touch the model
    detail: str = ""  # what was wrong with it, and what was expected

    @property
    def worker(self) -> int:
        return self.job.worker

    @property
    def ok(self) -> bool:
        return self.rejected is None


class Run(Protocol):
    """What an algorithm sees of the run it is part of (the driver, or a test's scripted run)."""

    @property
    def n(self) -> int:
        """Number of workers."""

    @property
    def x(self) -> np.ndarray:
        """The model (flat float vector); changed only through ``apply``."""

    @property
    def version(self) -> int:
        """Server updates applied so far (k)."""

    @property
    def virtual(self) -> bool:
        """True on the virtual clock."""

    @property
    def all_online(self) -> bool:
        """True when every worker is online for the whole run (the virtual clock, no availability model)."""

    @property
    def seed(self) -> int:
        """The run's seed (for the algorithm's own random choices)."""

    @property
    def concurrency(self) -> int:
        """C, the most jobs in flight (n when every worker is always busy)."""

    @property
    def periods(self) -> TauTable:
        """What the stepsize rules read as τ_i: each worker's mean time between deliveries p_i (its
        compute time when every worker is always busy, C = n)."""

    @property
    def strategy_state(self) -> Any:
        """The algorithm's own state (its ``State``): what its ``init_state`` returned at the start,
        or what a checkpoint restored. The algorithm changes it in place."""

    @property
    def compute_times(self) -> TauTable:
        """Each worker's mean compute time τ_i (the same table as ``periods`` when C = n)."""

    def apply(self, worker: int, update: np.ndarray, stepsize: float, booked: float | None = None) -> None:
        """x ← x − stepsize · update, one server update triggered by ``worker`` (``booked``: the
        stepsize entered in the cumulative-stepsize books when it differs)."""

    def send(self, worker: int) -> None:
        """A job on the current model for ``worker`` (queued behind its jobs in flight)."""

    def send_next(self, after: int | None) -> int | None:
        """A job on the current model for the worker the selection picks now that ``after``'s job
        ended (None: a first job). With C = n: ``after`` itself, if it is online. Returns the worker
        that got it (None: the slot waits)."""

    def resend(self, job: Job) -> None:
        """Another job for ``job``'s worker on the model ``job`` carried (keep working on x^k)."""

    def cancel_all(self) -> None:
        """Cancel every job in flight (their work so far is booked as discarded)."""

    def discard(self, job: Job) -> None:
        """Book a finished job whose reply the algorithm does not use."""

    def online_workers(self) -> list[int]:
        """The workers whose nodes are online (all of them on the virtual clock)."""

    def is_online(self, worker: int) -> bool: ...

    def node_of(self, worker: int) -> int:
        """The node ``worker`` is on now (a restarted SuperNode has a new id)."""

    def model_of(self, job: Job) -> np.ndarray:
        """The flat model ``job`` was computed on."""
