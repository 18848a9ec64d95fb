"""Time: compute-time (delay) models, the virtual clock and the wall clock.

Simulation runs on a *virtual* clock: every job's compute time is drawn from a delay model when
the job starts, so the order in which jobs finish is a pure function of the seed. Ties in finishing
time are broken by ascending worker index. A deployment runs on the *wall* clock: jobs finish when
their replies arrive and compute times are measured, not drawn.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

#: Compute times of the paper's MNIST study: two workers each at 1, 2, 4, 8 and 16 time units.
DEFAULT_TAUS: tuple[float, ...] = (1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0)

DELAY_KINDS = ("fixed", "exponential")


def tau_stats(taus: Sequence[float]) -> dict[str, float]:
    """Summary statistics of a list of compute times (experiments.md, "Problem")."""
    t = np.asarray(taus, dtype=np.float64)
    if t.size == 0 or np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise ValueError("compute times must be positive and finite")
    n = t.size
    return {
        "tau_max": float(t.max()),
        "tau_min": float(t.min()),
        "tau_A": float(t.mean()),
        "tau_H": float(n / np.sum(1.0 / t)),
        "tau_DA": float(n * np.sum(t**-3.0) / np.sum(t**-2.0) ** 2),
    }


def is_harmonic(taus: Sequence[float]) -> bool:
    """True when every ratio of two compute times (larger over smaller) is an integer."""
    t = sorted(float(x) for x in taus)
    for i, a in enumerate(t):
        for b in t[i + 1 :]:
            r = b / a
            if abs(r - round(r)) > 1e-9:
                return False
    return True


class DelayModel:
    """Per-worker compute times: fixed τ_i, or independent Exp(mean τ_i) draws.

    Each worker owns its own generator seeded from (seed, worker), so a worker's sequence of draws
    does not depend on how the other workers' jobs interleave with it.
    """

    def __init__(self, taus: Sequence[float], kind: str = "fixed", seed: int = 0) -> None:
        if kind not in DELAY_KINDS:
            raise ValueError(f"unknown delay model {kind!r}; choose one of {DELAY_KINDS}")
        tau_stats(taus)  # validates
        self.taus = tuple(float(x) for x in taus)
        self.kind = kind
        self.seed = int(seed)
        self._rngs = [np.random.default_rng((self.seed, 0xDE1A, i)) for i in range(len(self.taus))]

    @property
    def num_workers(self) -> int:
        return len(self.taus)

    def mean(self, worker: int) -> float:
        """Expected compute time of one job on ``worker``."""
        return self.taus[worker]

    def sample(self, worker: int) -> float:
        """Draw the compute time of the next job of ``worker``."""
        tau = self.taus[worker]
        if self.kind == "fixed":
            return tau
        return float(self._rngs[worker].exponential(tau))

    def __repr__(self) -> str:
        return f"DelayModel(kind={self.kind!r}, taus={list(self.taus)}, seed={self.seed})"


@runtime_checkable
class Clock(Protocol):
    """What the client manager needs of a clock. ``VirtualClock`` also has ``delays`` and
    ``job_duration(worker)``; ``WallClock`` has ``time_unit`` and ``restart()``."""

    virtual: bool

    @property
    def now(self) -> float: ...

    def advance(self, t: float) -> None: ...


class VirtualClock:
    """Simulated time driven by a delay model. ``now`` only moves when an event is processed."""

    virtual = True

    def __init__(self, delays: DelayModel) -> None:
        self.delays = delays
        self.now = 0.0

    def advance(self, t: float) -> None:
        if t < self.now - 1e-12:
            raise RuntimeError(f"virtual time cannot go back ({t} < {self.now})")
        self.now = max(self.now, t)

    def job_duration(self, worker: int) -> float:
        return self.delays.sample(worker)


class WallClock:
    """Real elapsed time since construction (seconds, scaled by ``time_unit``)."""

    virtual = False

    def __init__(self, time_unit: float = 1.0) -> None:
        if not time_unit > 0 or not math.isfinite(time_unit):
            raise ValueError("time_unit must be positive")
        self.time_unit = time_unit
        self._t0 = time.monotonic()

    @property
    def now(self) -> float:
        return (time.monotonic() - self._t0) / self.time_unit

    def restart(self, at: float = 0.0) -> None:
        """Count time from now, starting at ``at`` time units (a run's budget starts at its first
        job, not at start-up; a resumed run goes on from its checkpoint's time)."""
        self._t0 = time.monotonic() - at * self.time_unit

    def __getstate__(self) -> dict:  # (a checkpoint keeps the time reached, not this process's clock)
        return {"time_unit": self.time_unit, "_reached": self.now}

    def __setstate__(self, state: dict) -> None:
        self.time_unit = state["time_unit"]
        self.restart(state["_reached"])

    def advance(self, t: float) -> None:  # wall time advances by itself
        del t
