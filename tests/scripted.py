"""A scripted stand-in for the driver: feed a strategy completions by hand and see what it does.

``ScriptedRun`` implements ``fl_rescaled.algorithm.Run`` with no Grid, clock or manager: jobs are
records in a list, ``deliver``/``fail`` hand the strategy a completion of a worker's oldest job in
flight, and everything the strategy asks for (steps, jobs, resends, cancellations, discards) is
recorded, so a test can check an algorithm's completion logic alone, event by event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_rescaled.algorithm import Completion, Job
from fl_rescaled.stepsizes import TauTable


@dataclass
class Step:
    worker: int
    update: np.ndarray
    stepsize: float


@dataclass
class ScriptedRun:
    n: int
    x: np.ndarray
    periods: Any = None  # what the rules read: a TauTable, or a list of p_i = τ_i (default: all 1)
    virtual: bool = True
    all_online: bool = True
    online: set[int] | None = None
    nodes: list[int] | None = None
    version: int = 0
    seed: int = 0
    concurrency: int | None = None  # C (default n)
    steps: list[Step] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # the worker of every job sent, in order (resends too)
    resent: list[int] = field(default_factory=list)  # the worker of every resend
    cancelled: list[int] = field(default_factory=list)  # the job ids cancelled
    discarded: list[int] = field(default_factory=list)  # the job ids discarded
    inflight: list[Job] = field(default_factory=list)
    time: float = 0.0
    strategy_state: Any = None  # the algorithm's state (``start``: what its ``init_state`` returns)

    def __post_init__(self) -> None:
        self.x = np.array(self.x, dtype=float)
        if not isinstance(self.periods, TauTable):
            self.periods = TauTable(self.n, self.periods if self.periods is not None else [1.0] * self.n)
        self.online = set(range(self.n)) if self.online is None else set(self.online)
        self.concurrency = self.n if self.concurrency is None else self.concurrency
        self.compute_times = self.periods
        self.nodes = list(range(100, 100 + self.n)) if self.nodes is None else list(self.nodes)
        self.models = {0: self.x.copy()}  # version -> the model of that version
        self._next_id = 0

    # ------------------------------------------------------------------ the Run protocol
    def apply(self, worker: int, update: np.ndarray, stepsize: float, booked: float | None = None) -> None:
        self.steps.append(Step(worker, np.array(update, dtype=float), stepsize))
        self.x = self.x - stepsize * np.asarray(update, dtype=float)
        self.version += 1
        self.models[self.version] = self.x.copy()

    def send(self, worker: int) -> None:
        self._job(worker, self.version)

    def send_next(self, after: int | None) -> int | None:
        """C = n: ``after`` itself, if online; C < n (or a first job): the lowest online worker with
        no job in flight (a deterministic stand-in for the seeded draw). Returns the worker sent to."""
        if after is not None and self.concurrency == self.n:
            if after in self.online:
                self.send(after)
                return after
            return None
        busy = {j.worker for j in self.inflight}
        idle = [w for w in sorted(self.online) if w not in busy]
        if idle:
            self.send(idle[0])
            return idle[0]
        return None

    def resend(self, job: Job) -> None:
        self.resent.append(job.worker)
        self._job(job.worker, job.version)

    def cancel_all(self) -> None:
        self.cancelled.extend(j.job_id for j in self.inflight)
        self.inflight.clear()

    def discard(self, job: Job) -> None:
        self.discarded.append(job.job_id)

    def online_workers(self) -> list[int]:
        return sorted(self.online)

    def is_online(self, worker: int) -> bool:
        return worker in self.online

    def node_of(self, worker: int) -> int:
        return self.nodes[worker]

    def model_of(self, job: Job) -> np.ndarray:
        return self.models[job.version]

    # ------------------------------------------------------------------ the script
    def _job(self, worker: int, version: int) -> Job:
        job = Job(self._next_id, worker, version, 0, self.time, node_id=self.nodes[worker])
        self._next_id += 1
        self.sent.append(worker)
        self.inflight.append(job)
        return job

    def oldest(self, worker: int) -> Job:
        return next(j for j in self.inflight if j.worker == worker)

    def deliver(self, strategy: Any, worker: int, update: Any) -> Completion:
        """``worker``'s oldest job in flight finished with ``update``: the strategy handles it."""
        job = self.oldest(worker)
        self.inflight.remove(job)
        self.time += 1.0
        comp = Completion(job, self.time, self.version - job.version, np.array(update, dtype=float))
        strategy.on_completion(self, comp)
        return comp

    def fail(self, strategy: Any, worker: int, reason: str = "non-finite") -> Completion:
        """``worker``'s oldest job in flight came back unusable (``reason``)."""
        job = self.oldest(worker)
        self.inflight.remove(job)
        self.time += 1.0
        comp = Completion(job, self.time, self.version - job.version, rejected=reason)
        strategy.on_rejected(self, comp)
        return comp

    def start(self, strategy: Any) -> Any:
        """What the driver does at a run's start: the strategy's target weights in the τ table, a
        fresh state, then ``on_start``."""
        self.periods.set_weights(strategy.target_weights())
        self.strategy_state = strategy.init_state(self)
        strategy.on_start(self)
        return strategy
