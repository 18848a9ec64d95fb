"""The run's state, as one explicit record: what a checkpoint holds and a resumed run starts from.

``RunState`` is everything that changes during a run of an asynchronous strategy: the model, the
evaluation schedule and what was reported so far, the failure counters, the replicas' step sizes,
the manager's part (``ManagerState``: the clock and its random generators, the books, the roster,
the τ table, the jobs in flight with the model version each carries) and the strategy's own state
(a dataclass each strategy declares: buffers, tables, rounds). The driver (``fl_rescaled.driver``)
owns it; ``to_data``/``from_data`` turn it into JSON plus arrays and back, checked against the
schema (``fl_rescaled.codec``), for ``fl_rescaled.checkpoints``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoints import CheckpointError, read_state, write_state
from .codec import StateError, decode, encode
from .divergence import DivergenceState
from .manager import ManagerState
from .reporting import MetricWindow

#: Bumped whenever the layout of a run's state changes: older checkpoints are refused by name.
STATE_VERSION = 7


def budgets(time_budget: float | None, num_updates: int | None, eval_every: float | None,
            num_evaluations: int | None, num_trainings: int | None = None,
            num_rounds: int | None = None) -> tuple[float, int | None, int | None]:
    """Validated budgets: (time budget, inf if none; server updates, None if none; client
    trainings, None if none or set at the start from ``num_rounds``). ``num_updates``,
    ``num_trainings`` and ``num_rounds`` count the same run's work in three units (one FedBuff update
    is K trainings; a round is C trainings): give one of them, not two."""
    if sum(c is not None for c in (num_updates, num_trainings, num_rounds)) > 1:
        raise ValueError("give one of num_rounds (FedAvg's rounds: C client trainings each), num_trainings "
                         "(client trainings) and num_updates (server updates), not two")
    if time_budget is None and num_updates is None and num_trainings is None and num_rounds is None:
        raise ValueError("give a budget: num_rounds (FedAvg's work: C client trainings per round), num_trainings "
                         "(client trainings), num_updates (server updates) and/or time_budget (time units)")
    if time_budget is not None and not (time_budget > 0 and math.isfinite(time_budget)):
        raise ValueError(f"time_budget must be positive and finite, got {time_budget!r}")
    for name, count in (("num_updates", num_updates), ("num_trainings", num_trainings), ("num_rounds", num_rounds)):
        if count is not None and (isinstance(count, bool) or not isinstance(count, (int, float, np.integer))
                                  or int(count) != count or count < 1):
            raise ValueError(f"{name} must be a positive integer, got {count!r}")
    if eval_every is not None and not eval_every > 0:
        raise ValueError("eval_every must be positive")
    if num_evaluations is not None and (isinstance(num_evaluations, bool) or int(num_evaluations) != num_evaluations
                                        or num_evaluations < 1):
        raise ValueError(f"num_evaluations must be a positive integer, got {num_evaluations!r}")
    return (float(time_budget) if time_budget is not None else math.inf,
            int(num_updates) if num_updates is not None else None,
            int(num_trainings) if num_trainings is not None else None)


@dataclass
class EvalSchedule:
    """When to evaluate: every ``period`` time units, every ``updates`` server updates, or every
    ``trainings`` client trainings (the default: a round's worth, FedAvg's clients per round)."""

    period: float
    updates: int | None
    step: int = 0
    next_time: float = 0.0
    next_updates: int = 0
    trainings: int | None = None
    next_trainings: int = 0

    def __post_init__(self) -> None:
        if self.updates is not None and self.next_updates == 0:
            self.next_updates = self.updates
        if self.trainings is not None and self.next_trainings == 0:
            self.next_trainings = self.trainings

    @classmethod
    def first(cls, eval_every: float | None, num_evaluations: int | None, budget: float, max_updates: int | None,
              max_trainings: int | None, per_round: int = 1) -> EvalSchedule:
        """The schedule a run starts with (``budgets`` validated its arguments): every ``eval_every``
        time units; else ``num_evaluations`` points spread over the budget (time first, then updates,
        trainings); else, by default, a point every ``per_round`` trainings, FedAvg's clients per
        round C (FedAvg's cost: the run sets it again once it knows C, and its ``num_rounds``
        budget's trainings)."""
        if eval_every is not None:
            return cls(float(eval_every), None)
        if num_evaluations is None:
            return cls(math.inf, None, trainings=per_round)
        if math.isfinite(budget):
            return cls(budget / num_evaluations, None)
        if max_updates is not None:
            return cls(math.inf, max(1, math.ceil(max_updates / num_evaluations)))
        if max_trainings is None:  # (num_rounds: the trainings are known at the start, which sets it again)
            return cls(math.inf, None, trainings=1)
        return cls(math.inf, None, trainings=max(1, math.ceil(max_trainings / num_evaluations)))

    def advance(self, version: int, trainings: int = 0) -> None:
        self.step += 1
        self.next_time = self.step * self.period
        if self.updates is not None:
            self.next_updates = version + self.updates
        if self.trainings is not None:
            self.next_trainings = trainings + self.trainings

    def check(self) -> None:
        if not (self.period > 0) or self.step < 0 or any(c is not None and c < 1 for c in (self.updates, self.trainings)):
            raise ValueError("evaluation schedule: a positive period, update count or training count")


@dataclass
class RunState:
    """See the module docstring. ``algorithm`` is the strategy's state (its own dataclass)."""

    x: np.ndarray
    carried: dict[str, np.ndarray]
    schedule: EvalSchedule
    window: MetricWindow
    history: list[dict[str, Any]] = field(default_factory=list)
    train_metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    server_metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    client_metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    progress: dict[int, dict[str, Any]] = field(default_factory=dict)
    answered: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # workers heard from
    consecutive: int = 0  # replies rejected in a row
    replica_lrs: np.ndarray | None = None  # batched runs: each replica's α (0: frozen)
    frozen: dict[int, float] = field(default_factory=dict)  # replica -> time its gradient went non-finite
    divergence: DivergenceState = field(default_factory=DivergenceState)  # the watched loss, the best model
    manager: ManagerState | None = None  # (filled when the state is written or read)
    algorithm: Any = field(default=None, metadata={"transient": True})

    def check(self) -> None:
        if self.x.ndim != 1 or self.x.dtype.kind != "f":
            raise ValueError("the model must be a flat float vector")
        if self.replica_lrs is not None and (self.replica_lrs.ndim != 1 or not np.isfinite(self.replica_lrs).all()):
            raise ValueError("replica step sizes must be finite")
        if self.consecutive < 0 or any(not math.isfinite(t) for t in self.frozen.values()):
            raise ValueError("bad failure counters")

    def check_restored(self, fresh: RunState, n: int) -> None:
        """Raise ValueError unless this state, read from a checkpoint of ``n`` workers, fits the run
        whose starting state is ``fresh``: the model's layout, this run's evaluation schedule (the
        period or update count its command gives; the next point where the step says), one
        evaluation recorded per step, and a flag per worker heard from."""
        if self.x.shape != fresh.x.shape or self.x.dtype != fresh.x.dtype:
            raise ValueError("its model does not have the layout of this run's")
        mine, theirs = fresh.schedule, self.schedule
        if (theirs.period, theirs.updates, theirs.trainings) != (mine.period, mine.updates, mine.trainings):
            raise ValueError(f"its evaluation schedule (every {theirs.period!r} time units, {theirs.updates!r} "
                             f"updates or {theirs.trainings!r} trainings) is not this run's (every {mine.period!r}, "
                             f"{mine.updates!r} or {mine.trainings!r})")
        if theirs.step != len(self.history) or theirs.next_time != (theirs.step * theirs.period if theirs.step else 0.0):
            raise ValueError(f"its evaluation step {theirs.step!r} (next at {theirs.next_time!r}) does not fit its "
                             f"schedule and its {len(self.history)} evaluations")
        if self.answered.shape != (n,):
            raise ValueError("its record of the workers heard from does not fit its workers")
        lrs, given = self.replica_lrs, fresh.replica_lrs
        if (lrs is None) != (given is None) or (lrs is not None and (
                lrs.shape != given.shape or not ((lrs == given) | (lrs == 0)).all())):
            raise ValueError("its replicas' step sizes are not this run's (each α, or 0 once frozen)")

    def check_history(self, now: float, version: int, trainings: int = 0) -> None:
        """Raise ValueError when the schedule or the history is ahead of the restored clock's time
        ``now``, ``version`` (server updates) and ``trainings`` (client trainings), or the next point
        by updates or trainings is further than one period away."""
        for unit, every, due, done_so_far in (("updates", self.schedule.updates, self.schedule.next_updates, version),
                                              ("trainings", self.schedule.trainings, self.schedule.next_trainings,
                                               trainings)):
            if every is not None and not done_so_far < due <= done_so_far + every:
                raise ValueError(f"its next evaluation is due after {due!r} {unit}, which its {done_so_far} {unit} "
                                 f"and its schedule (every {every}) cannot give")
        last = self.history[-1] if self.history else {}
        when, done = last.get("time", 0.0), last.get("updates", 0)
        trained = last.get("trainings", 0)
        if not (isinstance(when, (int, float)) and isinstance(done, int) and isinstance(trained, int)) \
                or when > now or done > version or trained > trainings:
            raise ValueError(f"its last evaluation (at {last.get('time')!r}) is after its clock's time ({now!r}) or "
                             "its updates")


def to_data(state: RunState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``state`` (with its ``manager`` and ``algorithm`` filled in) as (JSON-able tree, arrays)."""
    arrays: dict[str, np.ndarray] = {}
    tree = {"run": encode(state, arrays, "run"), "algorithm": encode(state.algorithm, arrays, "algorithm")}
    return tree, arrays


def from_data(tree: Any, arrays: dict[str, np.ndarray], algorithm_type: type) -> RunState:
    """The ``RunState`` of ``to_data``, its strategy state of ``algorithm_type``; ``StateError``
    (one line, naming the field) when anything does not match the schema."""
    if not isinstance(tree, dict) or set(tree) != {"run", "algorithm"}:
        raise StateError("state: expected the run's and the strategy's records")
    state = decode(RunState, tree["run"], arrays, "run")
    if state.manager is None:
        raise StateError("run.manager: missing")
    state.algorithm = decode(algorithm_type, tree["algorithm"], arrays, "algorithm")
    return state


@dataclass(frozen=True)
class Checkpointing:
    """Where and how often a run writes its state, and whether it starts from it.

    ``fingerprint`` identifies the run (its settings, strategy and model): a checkpoint written
    under another fingerprint is refused. ``every``: time units between checkpoints.
    """

    path: Path
    every: float
    fingerprint: str
    resume: bool = False

    def covering(self, strategy: Any, layout: Any, budget: float, max_updates: int | None,
                 max_trainings: int | None = None, rounds: int | None = None) -> Checkpointing:
        """This plan with a fingerprint that also covers the strategy, its options, the model's layout
        and the budgets: a checkpoint of any other run is refused."""
        what = {"run": self.fingerprint, "strategy": type(strategy).__name__,
                "options": {k: repr(v) for k, v in strategy.describe().items()}, "model": layout.describe(),
                "budget": repr(budget), "updates": max_updates, **({"trainings": max_trainings} if max_trainings else {}),
                **({"rounds": rounds} if rounds else {})}
        digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
        return Checkpointing(self.path, self.every, digest, self.resume)


def save(plan: Checkpointing, state: RunState) -> None:
    """Write ``state`` (its ``manager`` and ``algorithm`` filled in) to ``plan.path``, atomically."""
    tree, arrays = to_data(state)
    write_state(plan.path, tree, arrays, plan.fingerprint, STATE_VERSION)


def load(plan: Checkpointing, algorithm_type: type) -> RunState:
    """The state ``save`` wrote for this run; ``CheckpointError`` (one line) for anything else."""
    tree, arrays = read_state(plan.path, plan.fingerprint, STATE_VERSION)
    try:
        return from_data(tree, arrays, algorithm_type)
    except StateError as exc:
        raise CheckpointError(f"{plan.path}: the run state does not match this version's schema: {exc}") from None
