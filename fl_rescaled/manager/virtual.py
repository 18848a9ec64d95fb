"""The virtual clock's completion source: when each job runs, and what happens next.

Each worker serves its jobs first in, first out: a job starts when the worker is free and takes a
compute time drawn from the clock's model (``fl_rescaled.delays``) when it starts. Completions come
out of a heap in order of finishing time, ties broken by worker index, then job id (O(log C) per
event for C jobs in flight, whatever the number of workers), whatever order the Grid computes replies
in; the source then waits for that job's reply (an in-process Grid computes it now, or has computed
it ahead). Cancelled jobs leave the heap lazily. A job's times are drawn before it is pushed, so
that one whose reply will not be read (its client goes offline first, or it ends after the budget
last asked for) is pushed unread (``Transport.push_job``): an in-process Grid never computes it.

With an availability model (``fl_rescaled.availability``) a job whose client goes offline before it
finishes is lost at that moment (``offline``: its reply is never computed), and the source tells
the manager when clients come back: a worker that lost its job that way (``joined``), and a slot
that found no client online (``woken``, at the earliest time an idle client is online again).

The source owns what the virtual clock decides: who is online (the availability model, on top of
the roster), the τ table the stepsize rules read (the model's exact means τ_i; with C < N or an
availability model each worker's mean time between deliveries, estimated from its deliveries),
what a failed or cancelled job cost, and its part of a checkpoint (``VirtualState``), which it
checks against its invariants when a run resumes (``restore``).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Message

from fl_rescaled.algorithm import Job
from fl_rescaled.clock import VirtualClock
from fl_rescaled.stepsizes import TauTable

from .membership import Membership
from .observers import ManagerObserver
from .reputation import may_be_aside
from .selection import Population
from .transport import Transport

#: Event kinds besides jobs, in the order they are handled at equal times.
JOINED, WOKEN = 0, 1
#: No job lasts longer than this many times the longest mean compute time (for the checks of a
#: restored state: an exponential time is longer with probability e^-1000000).
LONGEST = 1e6


@dataclass
class VirtualState:
    """The virtual clock's part of a checkpoint: the time, the compute-time model's generators, each
    worker's queue, the delivery-period estimates and the pending events."""

    now: float
    delays: dict[str, Any]  # the compute-time model's state (its generators)
    free_at: np.ndarray  # when each worker's queue empties
    periods: list[float] = field(default_factory=list)  # C < N or availability: the delivery periods p_i
    last_delivery: np.ndarray = field(default_factory=lambda: np.zeros(0))  # (``ema``) each one's last
    events: list[tuple[float, int, int]] = field(default_factory=list)  # clients coming back, slots to wake
    woken: int = 0


class VirtualSource:
    """The completion source of the virtual clock (see the module docstring)."""

    virtual = True

    def __init__(self, clock: VirtualClock, transport: Transport, membership: Membership,
                 observers: list[ManagerObserver], *, tau_smoothing: float = 0.2) -> None:
        self.clock = clock
        self.availability = clock.availability
        self.transport = transport
        self.membership = membership
        self.observers = observers
        self.free_at = np.zeros(0)  # per worker: the virtual time its queue empties
        self._heap: list[tuple[float, int, int, Job]] = []  # (time, worker, job id, job)
        self._cut: dict[int, float] = {}  # job id -> when: jobs whose client goes offline before they finish
        self._budget = math.inf  # the last budget asked for (``next``): a job ending after it is not read
        self._events: list[tuple[float, int, int]] = []  # (time, kind, worker)
        self._returning: set[int] = set()  # workers with a JOINED event pending (one each)
        self.woken = 0  # slots that waited for a client to come back, and can be filled now
        self.last_delivery = np.zeros(0)  # C < N, periods estimated: each worker's last accepted reply
        self.periods = self.compute_times = TauTable(0)  # what the rules read; the compute times τ_i
        self.periods_how = ""  # C < N or availability: how p_i is estimated ("average" / "ema")
        self.tau_smoothing = tau_smoothing  # (``ema``) weight of a new interval

    # ------------------------------------------------------------------ workers and their tables
    def tables(self, num_workers: int, weights: Sequence[float] | None) -> None:
        """The exact mean compute times of the clock's model, for ``num_workers`` workers."""
        if self.clock.delays.num_clients < num_workers:
            raise ValueError(f"the clock knows {self.clock.delays.num_clients} workers, the grid has {num_workers}")
        self.free_at = np.zeros(num_workers)
        self.periods = self.compute_times = TauTable(num_workers, self.clock.delays.means()[:num_workers].tolist(), weights)

    def populate(self, population: Population, weights: Sequence[float] | None) -> None:
        """With C < N, or an availability model, the rules read each worker's delivery period p_i
        (``Population.periods``), estimated as the run goes; with C = N the workers offline now get
        work when they come back."""
        n = population.n
        if population.sampled or self.availability is not None:
            self.periods, self.periods_how = population.periods(self.clock, weights)
            self.last_delivery = np.zeros(n)
        if not population.sampled:  # every worker busy whenever online: the offline join when they come
            self.returns(np.flatnonzero(~self.online_mask(np.arange(n))))

    def num_workers(self) -> int:
        return len(self.free_at)

    def is_online(self, worker: int) -> bool:
        """On the roster (not set aside) and online by the availability model."""
        return bool(self.membership.roster.online[worker]) and (
            self.availability is None or self.availability.online(worker, self.clock.now))

    def online_mask(self, workers: np.ndarray) -> np.ndarray:
        roster = self.membership.roster.online[workers]
        if self.availability is None:
            return roster
        return self.availability.online_mask(workers, self.clock.now) & roster

    def online_workers(self) -> list[int]:
        return np.flatnonzero(self.online_mask(np.arange(self.num_workers()))).tolist()

    def all_online(self) -> bool:
        """Every worker online for the whole run: no availability model, none set aside."""
        return self.availability is None and self.periods.n_active == self.periods.n

    @staticmethod
    def aside_seconds(strikes: int) -> float:
        """A failing client is set aside for good (it would fail again: its failures are the run's)."""
        del strikes
        return math.inf

    def start(self) -> None:
        """(The virtual clock starts at 0 with the run.)"""

    def dispatched(self, job: Job) -> bool:
        """``job`` is about to be pushed: it starts when its worker is free and competes for the next
        event. False when its reply will not be read: its client goes offline first, or it ends after
        the budget (the in-process Grid then leaves it uncomputed unless it is pulled after all)."""
        w = job.worker
        job.start_time = start = max(self.clock.now, float(self.free_at[w]))
        job.finish_time = start + self.clock.job_duration(w, start)
        self.free_at[w] = job.finish_time
        ends = self._ends_at(job)
        heapq.heappush(self._heap, (ends, w, job.job_id, job))
        return ends <= self._budget and job.job_id not in self._cut

    def _ends_at(self, job: Job) -> float:
        """When ``job`` ends: its finishing time, or earlier when its client goes offline first (then
        it is cut there)."""
        if self.availability is not None:
            off = self.availability.next_off(job.worker, job.start_time)
            if off < job.finish_time:
                self._cut[job.job_id] = off
                return off
        return job.finish_time

    def returns(self, workers: np.ndarray) -> None:
        """Tell the manager when each of ``workers`` (offline now) comes online (``joined``)."""
        if self.availability is not None and workers.size:
            for w, t in zip(workers.tolist(), self.availability.next_on_many(workers, self.clock.now).tolist()):
                self._return_at(w, t)

    def _return_at(self, worker: int, t: float) -> None:
        if np.isfinite(t) and worker not in self._returning:
            self._returning.add(worker)
            heapq.heappush(self._events, (t, JOINED, worker))

    def no_worker(self, population: Population, after: int | None) -> None:
        """No worker could take the next job: with C < N its slot waits, woken when the first idle
        client comes back; with C = N ``after``'s job ended as it went offline, and it gets work when
        it comes back."""
        if population.sampled:
            idle = population.idle_workers()
            if self.availability is not None and idle.size:
                back = float(self.availability.next_on_many(idle, self.clock.now).min())
                if np.isfinite(back):
                    heapq.heappush(self._events, (back, WOKEN, -1))
        elif after is not None:
            self.returns(np.array([after]))

    def take_woken(self) -> int:
        """The slots woken since the last call (they can be filled now)."""
        woken, self.woken = self.woken, 0
        return woken

    def next(self, budget: float) -> tuple[Job, Message | None, float, str | None] | None:
        """The next job to end and its reply (None past its TTL: lost; ``offline``: its client left),
        or None once the next event is after ``budget``, or when clients came back (``woken``, the
        membership's ``joined``): the caller gives them work, then asks again."""
        heap, inflight, events = self._heap, self.transport.inflight, self._events
        self._budget = budget
        while heap and heap[0][3].message_id not in inflight:
            self._cut.pop(heapq.heappop(heap)[2], None)  # cancelled or already completed
        t_job = heap[0][0] if heap else np.inf
        if events and events[0][0] <= t_job:
            if events[0][0] > budget:
                return None
            t, kind, worker = heapq.heappop(events)
            self.clock.advance(t)
            if kind == JOINED:
                self._returning.discard(worker)
                self.membership.joined.append(worker)
            else:
                self.woken += 1
            return None
        if t_job > budget:
            return None
        job = heap[0][3]
        off = self._cut.pop(job.job_id, None)
        if off is not None:
            heapq.heappop(heap)
            self.clock.advance(off)
            self.transport.grid.discard_messages([job.message_id])
            self._return_at(job.worker, self.availability.next_on(job.worker, off))  # type: ignore[union-attr]
            return job, None, off, "offline"
        t0 = time.perf_counter()
        reply = self.transport.await_reply(job)
        for obs in self.observers:
            obs.reply_awaited(job, time.perf_counter() - t0)
        self.clock.advance(job.finish_time)
        return job, reply, job.finish_time, None if reply is not None else "lost"

    def work(self, job: Job, t: float | None = None) -> float:
        """The compute time of a job that ended at ``t`` (default: its finishing time)."""
        end = job.finish_time if t is None else min(t, job.finish_time)
        return max(0.0, end - job.start_time)

    def failed(self, job: Job, t: float) -> float:
        """The compute time of a job that failed (or was lost) at ``t``: it ran until then."""
        return self.work(job, t)

    @staticmethod
    def cancelled_reply(job: Job, rep: Message) -> float:
        """(An in-process Grid never computes a cancelled job: no reply comes.)"""
        del job, rep
        return 0.0

    def cancel(self, job: Job) -> float:
        """Stop ``job`` now (its worker is free at once if it was its last job); the compute time it
        had used. An in-process Grid does not compute it at all."""
        now = self.clock.now
        elapsed = max(0.0, min(now, job.finish_time) - job.start_time)
        w = job.worker
        if job.finish_time >= self.free_at[w]:
            self.free_at[w] = min(self.free_at[w], max(now, job.start_time))
        self._cut.pop(job.job_id, None)
        self.transport.done(job)
        self.transport.grid.discard_messages([job.message_id])
        return elapsed

    def busy(self, done: np.ndarray, t: float) -> np.ndarray:
        """Each worker's compute time up to ``t``: its finished jobs' (``done``) plus the part of its
        jobs in flight that ran before ``t``."""
        busy = done.copy()
        for job in self.transport.inflight.values():
            if job.start_time < t:
                busy[job.worker] += min(job.finish_time, self._cut.get(job.job_id, job.finish_time), t) \
                    - job.start_time
        return busy

    def _delivered(self, worker: int, t: float, count: int) -> None:
        """C < N: worker's mean time between deliveries, from its ``count``-th delivery at ``t``.
        ``average``: (t + p_0) / (count + 1) with p_0 the starting (mean-field) value; ``ema``: an
        exponential moving average of the intervals (speeds that change)."""
        periods = self.periods
        if self.periods_how == "average":
            periods.update(worker, (t + periods.prior[worker]) / (count + 1))
            return
        measured = max(t - float(self.last_delivery[worker]), 1e-12)
        self.last_delivery[worker] = t
        periods.update(worker, (1 - self.tau_smoothing) * periods.taus[worker] + self.tau_smoothing * measured)

    def accepted(self, job: Job, metrics: dict, t: float, count: int) -> float:
        """An accepted reply at ``t``, its worker's ``count``-th: its compute time (the virtual
        clock's, whatever the client says); the worker's delivery period is updated when estimated."""
        del metrics
        if self.periods_how:
            self._delivered(job.worker, t, count)
        return self.work(job)

    @staticmethod
    def node_gone(job: Job) -> None:
        """(The availability model, not the nodes, says who is online on the virtual clock.)"""

    # ------------------------------------------------------------------ the checkpoint
    def snapshot(self) -> dict[str, VirtualState]:
        """This source's part of the manager's state (nothing copied)."""
        estimated = bool(self.periods_how)
        return {"virtual": VirtualState(float(self.clock.now), self.clock.delays.state(), self.free_at,
                                        list(self.periods.taus) if estimated else [],
                                        self.last_delivery if estimated else np.zeros(0), list(self._events),
                                        self.woken)}

    def restore(self, saved: Any, population: Population) -> tuple[list[Job], list[int]]:
        """Go on from the manager's ``saved`` state (its part ``saved.virtual``, and its jobs in flight,
        with their models): each value is checked first (``check_restored``), then the jobs are
        pushed again as they were, with the same finishing times, so their replies are the ones they
        would have been. Nothing is lost, and no worker needs a job it does not have."""
        state, jobs = saved.virtual, saved.jobs
        if state is None:
            raise ValueError("the checkpoint was written on the wall clock, and this run is on the virtual clock")
        self.check_restored(state, jobs, population)
        self.clock.advance(state.now)
        self.clock.delays.restore(state.delays)
        self.free_at = np.array(state.free_at, np.float64)
        if self.periods_how:
            self.last_delivery = np.array(state.last_delivery, np.float64)
            for worker, period in enumerate(state.periods):
                self.periods.update(worker, float(period))
        self.membership.aside_until[~self.membership.roster.online] = np.inf  # (set aside for good)
        for job in jobs:
            self.transport.push_job(job)
            self._heap.append((self._ends_at(job), job.worker, job.job_id, job))
        heapq.heapify(self._heap)
        self._events = [(float(t), int(kind), int(w)) for t, kind, w in state.events]
        heapq.heapify(self._events)
        self._returning = {w for _, kind, w in self._events if kind == JOINED}
        self.woken = int(state.woken)
        return [], []

    def check_restored(self, state: VirtualState, jobs: list[Job], population: Population) -> None:
        """Raise ValueError unless ``state`` is one this source could have written: a finite clock,
        jobs that started after they were sent and finish at or after the clock's time, queues that
        empty with their last job, delivery periods the time so far can give, events of known kinds
        for known workers not in the past, no more slots woken than waited, workers on this Grid's
        nodes, and at most half of them set aside."""
        n, now = self.num_workers(), state.now
        if not (math.isfinite(now) and now >= 0):
            raise ValueError(f"its clock reads {now!r}")
        latest = np.full(n, now)
        roster = self.membership.roster
        for job in jobs:
            if not (math.isfinite(job.finish_time) and 0 <= job.dispatch_time <= job.start_time <= job.finish_time
                    and job.dispatch_time <= now <= job.finish_time):
                raise ValueError(f"job {job.job_id} in flight was sent at {job.dispatch_time!r}, starts at "
                                 f"{job.start_time!r} and finishes at {job.finish_time!r}, which its clock "
                                 f"({now!r}) cannot have")
            if job.node_id != roster.node_ids[job.worker]:
                raise ValueError(f"job {job.job_id} in flight went to node {job.node_id}, not its worker's")
            latest[job.worker] = max(latest[job.worker], job.finish_time)
        free = state.free_at
        # (A worker whose job was cut when its client went offline stays busy until that job's
        # finishing time, in flight or not: no job is longer than LONGEST mean compute times.)
        horizon = np.maximum(latest, now + LONGEST * float(np.max(self.clock.delays.means()[:n], initial=1.0)))
        if free.shape != (n,) or free.dtype.kind != "f" or not np.isfinite(free).all() or (free < 0).any() \
                or (free > horizon).any():
            raise ValueError("the workers' queue times (when each is free) do not fit their jobs in flight")
        self._check_periods(state, n, now)
        self._check_events(state, n, now, population)
        unknown = set(roster.node_ids) - set(map(int, self.transport.grid.get_node_ids()))
        if unknown:
            raise ValueError(f"{len(unknown)} of its workers are on nodes this Grid does not have "
                             f"(e.g. {min(unknown)})")
        if not may_be_aside(int((~roster.online).sum()), n):
            raise ValueError(f"{int((~roster.online).sum())} of its {n} workers are set aside; at most half may be")

    def _check_periods(self, state: VirtualState, n: int, now: float) -> None:
        if not self.periods_how:
            if state.periods or state.last_delivery.size:
                raise ValueError("it estimates delivery periods, and this run reads the compute times")
            return
        periods, prior = np.asarray(state.periods, np.float64), np.asarray(self.periods.prior, np.float64)
        last = state.last_delivery
        if periods.shape != (n,) or not np.isfinite(periods).all() or (periods <= 0).any() \
                or (periods > now + prior).any():
            raise ValueError(f"its delivery periods are not what {now:g} time units of deliveries can give")
        if last.shape != (n,) or not np.isfinite(last).all() or (last < 0).any() or (last > now).any():
            raise ValueError("its workers' last deliveries do not fit its clock")

    def _check_events(self, state: VirtualState, n: int, now: float, population: Population) -> None:
        joined: set[int] = set()
        woken_events = 0
        for t, kind, worker in state.events:
            if kind == JOINED and 0 <= worker < n and worker not in joined:
                joined.add(worker)
            elif kind == WOKEN and worker == -1:
                woken_events += 1
            else:
                raise ValueError(f"an event of kind {kind!r} for worker {worker!r} (or a second return of a worker)")
            if not (math.isfinite(t) and t >= now):
                raise ValueError(f"an event at {t!r}, before its clock's time {now!r}")
        if state.events and self.availability is None:
            raise ValueError("it has clients coming back, and this run's clients are always online")
        if woken_events > population.concurrency or not 0 <= state.woken <= population.parked:
            raise ValueError(f"{state.woken} slots woken and {woken_events} to wake, with {population.parked} "
                             "waiting for a worker")
