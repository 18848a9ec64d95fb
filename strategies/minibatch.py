"""Naive Minibatch SGD: every worker computes one gradient per round, then waits."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fl_rescaled.algorithm import Run
from fl_rescaled.manager import Completion

from .base import AsyncStrategy


@dataclass
class MinibatchState:
    """The running sum of this round's updates (weighted: ``FedAvgSync``), its weight, and the
    workers that delivered one."""

    sum: np.ndarray = field(default_factory=lambda: np.zeros(0))
    arrived: set[int] = field(default_factory=set)
    count: int = 0  # updates in the sum this round
    weight: float = 0.0  # their total weight (the count when unweighted)


class MinibatchSGD(AsyncStrategy):
    """Naive Minibatch SGD: one gradient per worker per round, averaged; sampled rounds with C < N.

    The server steps with the average of the n gradients once all have arrived and sends the new
    model to everybody; fast workers sit idle until the slowest one finishes (the idle time is
    booked by the client manager). One step of size α per round; memory: one running sum.

    With ``concurrency`` C < N each round draws C workers from the idle, online ones (a lost job's
    slot is drawn again) and closes when C updates are in: synchronous FedAvg's sampled rounds.

    On the wall clock a round waits only for the workers that are online (the mean runs over those
    that delivered); a worker that comes back gets a job on the current model and joins the round.

    Parameters
    ----------
    **kwargs
        The options of every strategy: as in ``AsyncStrategy``; ``lr`` is the step of each round.
    """

    name = "minibatch"
    restarts_at_once = False
    State = MinibatchState
    #: Weight each update by its reply's ``weighted_by_key`` metric (``num-examples``), as FedAvg does.
    weighted = False

    def init_state(self, run: Run) -> MinibatchState:
        return MinibatchState(np.zeros_like(run.x))

    def check_state(self, state: MinibatchState, n: int, x: np.ndarray) -> None:
        if state.sum.shape != x.shape or not all(0 <= w < n for w in state.arrived):
            raise ValueError("Minibatch's running sum does not fit this run")

    def stored_vectors(self) -> int:
        return int(self.state.sum.size > 0)  # the running sum (once a run has started)

    def on_start(self, run: Run) -> None:
        self._new_round(run)

    def _new_round(self, run: Run) -> None:
        if run.concurrency < run.n:
            for _ in range(run.concurrency):
                run.send_next(None)
        else:
            for worker in run.online_workers():
                run.send(worker)

    def _round_done(self, run: Run) -> bool:
        """C updates are in (sampled rounds), or every online worker has delivered this round's (wall
        clock: a worker whose node left is not waited for)."""
        st = self.state
        if run.concurrency < run.n:
            return st.count >= run.concurrency
        if run.all_online:  # everyone is online: O(1) per arrival
            return len(st.arrived) == run.n
        return bool(st.arrived) and all(w in st.arrived for w in run.online_workers())

    def on_completion(self, run: Run, comp: Completion) -> None:
        st = self.state
        if self.weighted:
            w = _weight(comp.metrics.get(self.weighted_by_key))
            st.sum += w * comp.update
            st.weight += w
        else:
            st.sum += comp.update
            st.weight += 1.0
        st.count += 1
        st.arrived.add(comp.worker)
        if self._round_done(run):
            self._close_round(run, comp.worker)
        # else: this worker idles until the round ends

    def on_rejected(self, run: Run, comp: Completion) -> None:
        super().on_rejected(run, comp)  # its slot gets a job again (with C < N, on a worker drawn again)
        # The others may all be idle, waiting for the worker that just left.
        if run.concurrency == run.n and self._round_done(run):
            self._close_round(run, comp.worker)

    def on_joined(self, run: Run, worker: int) -> None:
        if worker not in self.state.arrived:  # a worker that already delivered waits for the next round
            run.send(worker)

    def _close_round(self, run: Run, trigger: int) -> None:
        st = self.state
        if self.weighted:
            run.apply(trigger, st.sum / st.weight, self.lr)
        else:
            run.apply(trigger, st.sum / len(st.arrived) if run.concurrency == run.n else st.sum / st.count, self.lr)
        st.sum[:] = 0
        st.arrived, st.count, st.weight = set(), 0, 0.0
        self._new_round(run)


class FedAvgSync(MinibatchSGD):
    """Synchronous FedAvg on the same engine, for comparisons at equal virtual time or equal work.

    Each round draws C clients (``concurrency``, or ``fraction_train`` as in Flower's FedAvg), waits
    for all of their replies and moves the model to the average of the models they return, weighted
    by ``num-examples`` (x ← x − α · Σ n_i Δ_i / Σ n_i, Δ_i = x − y_i; α = 1 is FedAvg). Its rounds
    last as long as the slowest sampled client: idle time is in the books.

    Parameters
    ----------
    **kwargs
        The options of every strategy: as in ``AsyncStrategy`` (``reply`` defaults to ``"model"``).
    """

    name = "fedavg"
    default_reply = "model"
    weighted = True


def _weight(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else 1.0
