"""Time: compute-time (delay) models, the virtual clock and the wall clock.

Simulation runs on a *virtual* clock: every job's compute time is drawn from a delay model when
the job starts, so the order in which jobs finish is a pure function of the seed. Ties in finishing
time are broken by ascending worker index. A deployment runs on the *wall* clock: jobs finish when
their replies arrive and compute times are measured, not drawn.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from .availability import Availability
from .delays import ComputeTimes, compute_times
from .grid_api import AsyncGrid

log = logging.getLogger("flwr.fl_rescaled")

#: Compute times of the paper's MNIST study: two workers each at 1, 2, 4, 8 and 16 time units.
DEFAULT_TAUS: tuple[float, ...] = (1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0)

#: The compute-time models a run can name (``--delays``; ``trace`` reads a file: ``--delay-trace``).
DELAY_KINDS = ("fixed", "exponential", "lognormal", "pareto", "trace")


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


def DelayModel(taus: Sequence[float], kind: str = "fixed", seed: int = 0) -> ComputeTimes:  # noqa: N802
    """Per-client compute times of mean τ_i: a model of ``fl_rescaled.delays`` by name (``fixed``:
    exactly τ_i; ``exponential``, ``lognormal``, ``pareto``: draws of mean τ_i from each client's own
    generator, seeded by (seed, client), so a client's draws do not depend on how the others' jobs
    interleave with it). The name is the one this factory had when it built only the first two."""
    tau_stats(taus)  # validates
    return compute_times(kind, list(taus), seed=seed)


@runtime_checkable
class Clock(Protocol):
    """What the client manager needs of a clock. ``VirtualClock`` also has ``delays``,
    ``availability`` and ``job_duration``; ``WallClock`` has ``time_unit`` and ``restart()``."""

    virtual: bool
    #: How a time of this clock reads in a log line (" units", " s", " × 0.02 s").
    unit_label: str

    @property
    def now(self) -> float: ...

    def advance(self, t: float) -> None: ...


class VirtualClock:
    """Simulated time: ``now`` moves only when an event is processed. ``delays`` gives each job's
    compute time (a ``ComputeTimes`` model); ``availability`` when each client is online (None:
    always)."""

    virtual = True
    unit_label = " units"

    def __init__(self, delays: ComputeTimes, availability: Availability | None = None) -> None:
        self.delays = delays
        self.availability = availability
        self.now = 0.0

    @property
    def num_workers(self) -> int:
        """The clients the compute-time model knows (a run uses as many workers, by default)."""
        return self.delays.num_clients

    def advance(self, t: float) -> None:
        if t < self.now - 1e-12:
            raise RuntimeError(f"virtual time cannot go back ({t} < {self.now})")
        self.now = max(self.now, t)

    def job_duration(self, worker: int, start: float) -> float:
        """The compute time of ``worker``'s next job, which starts at ``start``."""
        return self.delays.sample(worker, start)


class WallClock:
    """Real elapsed time (seconds, scaled by ``time_unit``) since construction or ``restart`` (a run
    restarts it when its strategy's ``start()`` is called)."""

    virtual = False
    availability = None  # (nodes come and go by themselves)
    num_workers = None  # (as many as there are nodes)

    def __init__(self, time_unit: float = 1.0) -> None:
        if not time_unit > 0 or not math.isfinite(time_unit):
            raise ValueError("time_unit must be positive")
        self.time_unit = time_unit
        self._t0 = time.monotonic()

    @property
    def now(self) -> float:
        return (time.monotonic() - self._t0) / self.time_unit

    @property
    def unit_label(self) -> str:
        """" s" (seconds), or " × 0.02 s" in units of ``time_unit`` seconds."""
        return " s" if self.time_unit == 1.0 else f" × {self.time_unit:g} s"

    def restart(self, at: float = 0.0) -> None:
        """Count time from now, starting at ``at`` time units (a run starts at 0 when its strategy's
        ``start()`` is called; a resumed run goes on from its checkpoint's time)."""
        self._t0 = time.monotonic() - at * self.time_unit

    def advance(self, t: float) -> None:  # wall time advances by itself
        del t


def default_clock(grid: AsyncGrid, taus: list[float] | None, num_workers: int | None, partition_query: bool,
                  uses_tau: bool = True) -> Clock:
    """A virtual clock on a Grid with virtual time (in-process), else (Flower's runtimes) the wall clock.

    The virtual clock's τ_i: ``taus`` (per partition), else each node's ``tau`` node-config key (1 if
    unset), in worker order. For a strategy whose steps follow τ (``uses_tau``), one warning when
    every τ is the same.
    """
    if grid.virtual_time:
        if taus is None:
            nodes = sorted(int(n) for n in grid.get_node_ids())
            if partition_query:  # the worker order is the partition order
                nodes.sort(key=lambda n: int(grid.node_config(n).get("partition-id", 0)))
            taus = [float(grid.node_config(n).get("tau", 1.0)) for n in nodes]
            if num_workers is not None:
                taus = taus[:num_workers]
            if uses_tau and len(set(taus)) == 1 and len(taus) > 1:
                log.warning("every node's compute time τ is %g (set 'tau' in the node configs or pass "
                            "taus): time-proportional stepsizes change nothing", taus[0])
        return VirtualClock(DelayModel(taus, "fixed"))
    if taus is not None:
        raise ValueError("taus define a virtual clock; this Grid runs on the wall clock (pass clock=...)")
    return WallClock()
