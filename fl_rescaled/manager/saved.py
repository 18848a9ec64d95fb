"""The client manager's part of a run's state: what a checkpoint keeps of it (``ManagerState``),
taken from a running manager (``snapshot``) and put back into a fresh one (``restore``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_rescaled.bounds import BoundState
from fl_rescaled.layout import decode_array

from .books import Books
from .jobs import Job
from .membership import Roster
from .selection import PopulationState
from .virtual import VirtualSource

if TYPE_CHECKING:
    from .manager import AsyncClientManager


@dataclass
class ManagerState:
    """The manager's part of the run's state (``fl_rescaled.runstate``)."""

    books: Books
    roster: Roster
    taus: list[float]  # the τ table the stepsize rules read (NaN: no estimate yet)
    active: list[bool]
    clock_now: float
    delays: dict[str, Any]  # the compute-time model's state (virtual clock: its generators)
    free_at: np.ndarray  # virtual clock: when each worker's queue empties
    last_delivery: np.ndarray  # virtual clock with estimated periods: each worker's last delivery
    next_job_id: int
    population: PopulationState
    events: list[tuple[float, int, int]]  # virtual clock: clients coming back, slots to wake
    woken: int
    jobs: list[Job]  # in flight, in push order
    models: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # version -> the model jobs carry
    bounds: list[BoundState] = field(default_factory=list)  # the update bounds' states


def snapshot(m: AsyncClientManager) -> ManagerState:
    """The manager's part of the run's state (a snapshot to write; nothing is copied)."""
    jobs = list(m.transport.inflight.values())
    models: dict[int, dict[str, np.ndarray]] = {}
    for job in jobs:
        if job.version not in models and job.model is not None:
            models[job.version] = {k: np.array(decode_array(a)) for k, a in job.model.items()}
    src = m.source
    virtual = isinstance(src, VirtualSource)
    return ManagerState(
        books=m.books, roster=m.membership.roster, taus=list(m.taus.taus), active=[bool(a) for a in m.taus.active],
        clock_now=float(m.clock.now), delays=m.clock.delays.state() if virtual else {},
        free_at=src.free_at if virtual else np.zeros(0),
        last_delivery=src.last_delivery if virtual else np.zeros(0),
        next_job_id=m._next_job_id, population=m.population.state(),  # noqa: SLF001
        events=list(src._events) if virtual else [], woken=src.woken if virtual else 0,  # noqa: SLF001
        jobs=jobs, models=models, bounds=m.bound_state)


def restore(m: AsyncClientManager, state: ManagerState, concurrency: int | None, seed: int,
            weights: list[float] | None, timeout: float, selection: str = "uniform") -> int:
    """Go on from ``state`` (read from a checkpoint, on this manager's Grid and clock).

    Virtual clock: the jobs that were in flight are sent again, as they were (same model,
    config and finishing time), so the run continues as if it had never stopped. Wall clock:
    they are booked as lost (``resumed``: the nodes may have answered a server that no longer
    exists), the nodes are found again, and the clock goes on from the checkpoint's time.
    Returns how many jobs were lost.
    """
    n = state.books.n
    if len(state.roster.node_ids) != n or len(state.taus) != n or len(state.active) != n:
        raise ValueError("the checkpoint's books, roster and τ table disagree on the number of workers")
    if m.bound is not None:
        m.bound.check(state.bounds)
    elif state.bounds:
        raise ValueError("the checkpoint has update bounds and this run has none")
    m.books, m.bound_state = state.books, state.bounds
    m.membership.use(state.roster)
    m.taus = m.compute_taus = m.source.tau_table(n, weights)
    m.populate(concurrency, seed, weights, selection)
    m.population.restore(state.population)
    m._next_job_id = state.next_job_id
    records = {v: m.layout.record_of(arrays, f"the checkpoint's model of version {v}")
               for v, arrays in state.models.items()}
    for job in state.jobs:
        if job.version not in records or not 0 <= job.worker < n:
            raise ValueError(f"a job in flight (id {job.job_id}) has no model or no worker")
        job.model = records[job.version]
    for worker, (tau, active) in enumerate(zip(state.taus, state.active)):
        if tau == tau and not m.taus.fixed:  # (estimates: go on from the checkpoint's)
            m.taus.update(worker, tau)
        m._set_active(worker, active)  # (a worker set aside stays aside)
    if isinstance(m.source, VirtualSource):
        m.membership.aside_until[~state.roster.online] = np.inf  # (only set_aside takes a worker off the roster)
        if state.free_at.shape != (n,) or (m.periods_online and state.last_delivery.shape != (n,)):
            raise ValueError("the checkpoint's queue times do not match its workers")
        m.clock.advance(state.clock_now)
        m.clock.delays.restore(state.delays)
        m.source.last_delivery = state.last_delivery
        m.source.resume(state.jobs, state.free_at)
        m.source.set_events(state.events)
        m.source.woken = state.woken
        return 0
    m.clock.restart(state.clock_now)
    for job in state.jobs:  # (not pushed again: they are lost)
        m.books.ended(job.worker, "lost.resumed", "the server restarted")
        m._if_idle(job.worker)
    m.source.resume(timeout)
    return len(state.jobs)
