"""The driver's side of the contract with an algorithm (the other side, what an algorithm may do to
the run, is the ``Run`` protocol of ``fl_rescaled.algorithm``).

- ``Algorithm``: what the driver reads of a strategy: its hooks, its state's type and its option
  groups, each declared by the part that uses it (``PopulationOptions`` in the manager's
  selection, ``EvaluationOptions`` in reporting, ``BoundOptions`` in the bounds, ``RunOptions``
  here: the driver's own). ``AsyncStrategy`` implements it; the driver reads nothing else.
- ``RunAPI``: ``Run`` on the real run: what the algorithm's calls do to the model and the manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

from .algorithm import Completion, Job, Run
from .bounds import BoundOptions
from .manager import AsyncClientManager
from .manager.selection import PopulationOptions
from .reporting import EvaluationOptions
from .stepsizes import TauTable


@dataclass
class RunOptions:
    """The driver's options (``AsyncStrategy``'s ``arrayrecord_key``, ``configrecord_key``,
    ``max_consecutive_rejections``; documented there)."""

    arrayrecord_key: str = "arrays"
    configrecord_key: str = "config"
    max_consecutive_rejections: int | None = None


class Algorithm(Protocol):
    """What the driver reads of a strategy (``fl_rescaled.strategies.AsyncStrategy``)."""

    name: str
    #: What a reply's arrays are: "gradient" or "model".
    reply: str
    #: The dataclass of the algorithm's state (what ``init_state`` returns; checkpoints decode it).
    State: type
    #: Whether the steps follow each worker's τ (the default clock warns when every τ is equal).
    uses_tau: bool
    population: PopulationOptions
    evaluation: EvaluationOptions
    bounds: BoundOptions
    run_options: RunOptions

    @property
    def configures_jobs(self) -> bool:
        """Whether ``configure_job`` changes the jobs' config (else none is built per job)."""

    def init_state(self, run: Run) -> Any: ...

    def check_state(self, state: Any, n: int, x: np.ndarray) -> None: ...

    def on_start(self, run: Run) -> None: ...

    def on_completion(self, run: Run, comp: Completion) -> None: ...

    def on_rejected(self, run: Run, comp: Completion) -> None: ...

    def on_joined(self, run: Run, worker: int) -> None: ...

    def configure_job(self, config: ConfigRecord, *, updates: int, time: float) -> ConfigRecord: ...

    def on_evaluation(self, step: int, arrays: ArrayRecord, metrics: dict[str, MetricRecord]) -> None: ...

    def influence(self, run: Run, worker: int) -> float: ...

    def target_weights(self) -> Sequence[float] | None: ...

    def stored_vectors(self, state: Any) -> int: ...

    def summary(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...

    def report(self, state: Any) -> dict[str, Any]:
        """What the algorithm reports of its ``state`` at each evaluation and in the result ({}: nothing;
        a private run: its ``"dp"`` object)."""

    def stopped(self, state: Any) -> str | None:
        """Why the run must stop now (a private run's clients are out of budget), or None."""

    #: None, or ``admits(state, worker)``: whether ``worker`` may be selected for a job (a private
    #: run's budgets; ``Population.admit_only`` with C < N).
    admits: Any


class RunAPI:
    """The driver's side of ``Run``: what the algorithm's calls do to the model and the manager."""

    manager: AsyncClientManager
    state: Any  # the driver's RunState
    strategy: Algorithm
    configures_jobs: bool
    _scratch: np.ndarray
    #: True once the budget is spent and the run only waits for the jobs in flight
    #: (``finish_in_flight``): the algorithm's requests for jobs then send nothing.
    closed: bool = False

    @property
    def n(self) -> int:
        return self.manager.num_workers

    @property
    def x(self) -> np.ndarray:
        return self.state.x

    @property
    def version(self) -> int:
        return self.manager.books.version

    @property
    def strategy_state(self) -> Any:
        return self.state.algorithm

    @property
    def virtual(self) -> bool:
        return self.manager.source.virtual

    @property
    def all_online(self) -> bool:
        return self.manager.source.all_online()

    @property
    def concurrency(self) -> int:
        return self.manager.population.concurrency

    @property
    def periods(self) -> TauTable:
        return self.manager.periods

    @property
    def compute_times(self) -> TauTable:
        return self.manager.compute_times

    def apply(self, worker: int, update: np.ndarray, stepsize: float, booked: float | None = None) -> None:
        x = self.state.x
        scratch = self._scratch
        if scratch.shape != x.shape:
            scratch = self._scratch = np.empty_like(x)
        lrs = self.state.replica_lrs
        if lrs is None:
            np.multiply(update, stepsize, out=scratch, casting="same_kind")
        else:  # each replica's step in the update's precision, as its own run would take α · γ_unit
            R = len(lrs)
            steps = (stepsize * lrs).astype(update.dtype)
            np.multiply(update.reshape(R, -1), steps[:, None], out=scratch.reshape(R, -1))
        np.subtract(x, scratch, out=x)
        self.manager.record_update(worker, stepsize if booked is None else booked)

    def send(self, worker: int) -> None:
        if not self.closed:
            self.manager.send(worker, self.state.x, self.version, self.job_config(), self.state.carried)

    def send_next(self, after: int | None) -> int | None:
        if self.closed:
            return None
        job = self.manager.send_next(after, self.state.x, self.version, self.job_config(), self.state.carried)
        return None if job is None else job.worker

    def refill(self) -> None:
        if not self.closed:
            self.manager.refill(self.state.x, self.version, self.job_config(), self.state.carried)

    def resend(self, job: Job) -> None:
        if not self.closed:
            self.manager.resend(job, self.job_config())

    def cancel_all(self) -> None:
        self.manager.cancel_all()

    def discard(self, job: Job) -> None:
        self.manager.discard(job)

    def online_workers(self) -> list[int]:
        return self.manager.online_workers()

    def is_online(self, worker: int) -> bool:
        return self.manager.is_online(worker)

    def node_of(self, worker: int) -> int:
        return self.manager.membership.roster.node_ids[worker]

    def model_of(self, job: Job) -> np.ndarray:
        return self.manager.model_of(job)

    def job_config(self) -> dict | None:
        """The strategy's per-job config (``configure_job``), when it has one."""
        if not self.configures_jobs:
            return None
        cfg = self.strategy.configure_job(ConfigRecord(self.manager.train_config), updates=self.version,
                                          time=float(self.manager.clock.now))
        return dict(cfg.items())
