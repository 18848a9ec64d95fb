"""What the manager tracks per job and hands the strategy per finished job."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from fl_rescaled.layout import all_finite

#: Failure reasons that mean the node itself is gone (not just this job): Flower's
#: MESSAGE_UNAVAILABLE (expired in transit), NODE_UNAVAILABLE, our own TTL expiry, and a client that
#: went offline (an availability model on the virtual clock).
NODE_GONE = ("error-code-3", "error-code-5", "ttl-expired", "offline")


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


def zero_nonfinite_replicas(flat: np.ndarray, replicas: int) -> tuple[np.ndarray, list[int]]:
    """A batched reply (R replicas' vectors end to end) with the non-finite replicas' rows zeroed
    (in a copy) and their indices, instead of a rejection for every replica (they are frozen)."""
    if all_finite(flat):
        return flat, []
    rows = flat.reshape(replicas, -1).copy()
    bad = ~np.isfinite(rows).all(axis=1)
    rows[bad] = 0.0
    return rows.reshape(-1), [int(r) for r in np.flatnonzero(bad)]
