"""The wall clock's completion source: replies in arrival order, TTLs, nodes that come and go, τ online.

A deployment's jobs finish when their replies arrive. The source hands them over in arrival order;
a job with no reply within its TTL is lost (``ttl-expired``); every ``node_refresh`` seconds it
looks for nodes that left or (re)appeared (``Membership``), and returns early when a worker joined
so the strategy can give it work. Each worker's mean compute time τ_i is estimated online, as an
exponential moving average (initialised by the first measurement) of the time between its
deliveries (``interval``) or of its reported compute time (``compute``). A client's report is never
trusted beyond what the server saw: it is clamped to the time from the job's dispatch to its reply.

The source owns what the wall clock decides: who is online (the nodes the Grid lists), the τ
estimates, what a failed job cost (nothing measurable), how long a failing client is set aside
(``reputation.backoff_seconds``), when the clock starts (at ``start()``: the nodes' start-up is in
the budget), and its part of a checkpoint (``WallState``: the time and the estimates), checked when
a run resumes (``restore``).

Nothing is waited for in silence: every ``grid_api.WAIT_NOTICE_EVERY`` seconds (a minute) in which
no job finished, a warning says how many jobs are in flight, the oldest one's age and node, and when
its TTL books it lost (or, with no job in flight, that the run waits for nodes to come back).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Message

from fl_rescaled.algorithm import Job
from fl_rescaled.clock import WallClock
from fl_rescaled.grid_api import Quiet, seconds
from fl_rescaled.messages import reply_metrics
from fl_rescaled.stepsizes import TauTable

from .membership import Membership
from .reputation import backoff_seconds
from .selection import Population
from .transport import Transport

TAU_ESTIMATORS = ("interval", "compute")
log = logging.getLogger("flwr.fl_rescaled")


def reported_compute_time(metrics: dict[str, Any], observed: float) -> float:
    """The compute time a reply reports (``compute-time``, seconds), clamped to ``observed`` (the
    seconds from the job's dispatch to its reply); ``observed`` when the report is missing, not a
    number, not finite or not positive."""
    reported = metrics.get("compute-time")
    if isinstance(reported, (int, float)) and not isinstance(reported, bool) and math.isfinite(reported) \
            and reported > 0:
        return min(float(reported), observed)
    return observed


@dataclass
class WallState:
    """The wall clock's part of a checkpoint: the time, and each worker's τ estimate (NaN: none yet)."""

    now: float
    estimates: list[float]


class WallSource:
    """The completion source of the wall clock (see the module docstring)."""

    virtual = False
    woken = 0  # (no slot waits for a clock event here: nodes come back by themselves)

    def __init__(self, clock: WallClock, transport: Transport, membership: Membership, *,
                 tau_estimator: str = "interval", tau_smoothing: float = 0.2, poll_interval: float = 0.002) -> None:
        if tau_estimator not in TAU_ESTIMATORS:
            raise ValueError(f"tau_estimator must be one of {TAU_ESTIMATORS}, got {tau_estimator!r}")
        self.clock = clock
        self.transport = transport
        self.membership = membership
        self.tau_estimator = tau_estimator
        self.tau_smoothing = tau_smoothing
        self.poll_interval = poll_interval
        self.periods = TauTable(0)
        self.last_delivery = np.zeros(0)  # per worker: time.monotonic() of its last accepted reply
        self.quiet: Quiet | None = None  # since the last completion handed over (None: none awaited yet)

    # ------------------------------------------------------------------ workers and their tables
    def tables(self, num_workers: int, weights: Sequence[float] | None) -> None:
        """Estimates that start unknown and come in with the deliveries."""
        self.last_delivery = np.full(num_workers, math.nan)
        self.periods = TauTable(num_workers, None, weights)

    @property
    def compute_times(self) -> TauTable:
        """(One table: the time between a worker's deliveries, or its reported compute time.)"""
        return self.periods

    def populate(self, population: Population, weights: Sequence[float] | None) -> None:
        """(The estimates are the same whatever C: every worker is measured as it delivers.)"""
        del population, weights

    def is_online(self, worker: int) -> bool:
        return bool(self.membership.roster.online[worker])

    def online_mask(self, workers: np.ndarray) -> np.ndarray:
        return self.membership.roster.online[workers]

    def online_workers(self) -> list[int]:
        return self.membership.online_workers()

    @staticmethod
    def all_online() -> bool:
        """(Nodes may leave at any time.)"""
        return False

    @staticmethod
    def aside_seconds(strikes: int) -> float:
        """A failing client is set aside for a while (``reputation.backoff_seconds``): a device may recover."""
        return backoff_seconds(strikes)

    def start(self) -> None:
        """The clock, and so the budget, counts from the strategy's ``start()`` (as FedAvg's "Strategy
        execution finished in" does): the nodes' start-up (Ray's actors, a SuperNode's process) is in it."""
        self.clock.restart()

    def no_worker(self, population: Population, after: int | None) -> None:
        """(Nodes come back by themselves: the membership says when.)"""
        del population, after

    @staticmethod
    def take_woken() -> int:
        return 0

    def dispatched(self, job: Job) -> bool:
        job.start_time = self.clock.now
        return True

    def next(self, budget: float) -> tuple[Job, Message | None, float, str | None] | None:
        """The next reply to arrive (or the oldest job past its TTL, lost); None past ``budget``
        or when a worker (re)joined (the strategy gives it a job, then asks again)."""
        transport, membership = self.transport, self.membership
        if self.quiet is None:
            self.quiet = Quiet()
        while True:
            if self.clock.now > budget:
                return None
            if membership.due():
                membership.refresh()
            if membership.joined:
                return None
            mid = transport.next_arrival() if transport.inflight else None
            if mid is not None:
                self.quiet = None
                return transport.inflight[mid], transport.arrived.pop(mid), self.clock.now, None
            expired = transport.expired_job()
            if expired is not None:
                self.quiet = None
                return expired, None, self.clock.now, "ttl-expired"
            now = time.monotonic()
            if self.quiet.due(now):
                log.warning("%s", self.waiting(now))
            time.sleep(self.poll_interval)

    def waiting(self, now: float) -> str:
        """What the run waits for (the log line of a long silence)."""
        silent = seconds(now - self.quiet.since) if self.quiet is not None else "0 s"
        inflight = self.transport.inflight
        if not inflight:
            offline = self.membership.roster.online.size - len(self.membership.online_workers())
            return (f"no job in flight and none finished for {silent}: waiting for nodes to come back "
                    f"({offline} of {self.membership.roster.online.size} workers offline)")
        oldest = next(iter(inflight.values()))
        age = now - oldest.pushed_at
        return (f"{len(inflight)} job(s) in flight and none finished for {silent}; the oldest, job {oldest.job_id} "
                f"on node {oldest.node_id}, was sent {seconds(age)} ago: its TTL ({seconds(self.transport.ttl)}) "
                f"books it lost in {seconds(max(0.0, self.transport.ttl - age))} if no reply comes")

    @staticmethod
    def work(job: Job) -> float:
        """The compute time booked for a finished job (0 until a reply gave one)."""
        return job.finish_time - job.start_time if math.isfinite(job.finish_time) else 0.0

    def compute_time(self, job: Job, metrics: dict[str, Any]) -> float:
        """A reply's compute time in time units, clamped to what the server saw."""
        observed = max(time.monotonic() - job.pushed_at, 1e-9)
        return reported_compute_time(metrics, observed) / self.clock.time_unit

    @staticmethod
    def failed(job: Job, t: float) -> float:
        """(A failed job's compute time is not known: nothing is booked.)"""
        del job, t
        return 0.0

    def accepted(self, job: Job, metrics: dict[str, Any], t: float, count: int) -> float:
        """An accepted reply: update its worker's τ estimate; returns its compute time."""
        del t, count
        now = time.monotonic()
        compute = self.compute_time(job, metrics)
        job.finish_time = job.start_time + compute
        if self.tau_estimator == "compute":
            measured = compute
        else:  # time between this worker's deliveries (its first: since the job was sent)
            last = self.last_delivery[job.worker]
            since = last if not math.isnan(last) else job.pushed_at
            measured = max(now - since, 1e-9) / self.clock.time_unit
        self.last_delivery[job.worker] = now
        old = self.periods.taus[job.worker]
        a = self.tau_smoothing
        self.periods.update(job.worker, measured if math.isnan(old) else (1 - a) * old + a * measured)
        return compute

    def cancel(self, job: Job) -> float | None:
        """A remote job cannot be stopped, only ignored: the compute time of its reply if it has
        already come, else None (its reply, if it comes, is booked as wasted work then)."""
        rep = self.transport.cancel(job)
        return None if rep is None else self.cancelled_reply(job, rep)

    def cancelled_reply(self, job: Job, rep: Message) -> float:
        """The compute time of a cancelled job's reply (validated and clamped like any other)."""
        return self.compute_time(job, reply_metrics(rep.content) if rep.has_content() else {})

    def node_gone(self, job: Job) -> None:
        """``job``'s node is gone for now (until it reappears), unless the worker has already moved
        to a new node."""
        if job.node_id == self.membership.roster.node_ids[job.worker]:
            self.membership.set_online(job.worker, False)

    @staticmethod
    def busy(done: np.ndarray, t: float) -> np.ndarray:
        del t
        return done

    # ------------------------------------------------------------------ the checkpoint
    def snapshot(self) -> dict[str, WallState]:
        """This source's part of the manager's state."""
        return {"wall": WallState(float(self.clock.now), list(self.periods.taus))}

    def restore(self, saved: Any, population: Population) -> tuple[list[Job], list[int]]:
        """Go on from the manager's ``saved`` state (its part ``saved.wall``, checked first): the jobs
        that were in flight are lost (the nodes may have answered a server that no longer exists; the
        caller books them), the nodes are found again, the τ estimates go on, and the clock goes on
        from the checkpoint's time. Returns the lost jobs and the workers online, which need jobs."""
        del population
        state = saved.wall
        if state is None:
            raise ValueError("the checkpoint was written on the virtual clock, and this run is on the wall clock")
        n = len(self.periods.taus)
        if not (math.isfinite(state.now) and state.now >= 0):
            raise ValueError(f"its clock reads {state.now!r}")
        estimates = np.asarray(state.estimates, np.float64)
        known = estimates[~np.isnan(estimates)]
        if estimates.shape != (n,) or not np.isfinite(known).all() or (known <= 0).any():
            raise ValueError("its τ estimates are not one positive number (or none yet) per worker")
        for worker, tau in enumerate(state.estimates):
            if tau == tau:
                self.periods.update(worker, float(tau))
        self.clock.restart(state.now)
        self.membership.rediscover(min(self.transport.ttl, 300.0))
        return list(saved.jobs), self.online_workers()
