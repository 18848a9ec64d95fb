"""Naive Minibatch SGD: every worker computes one gradient per round, then waits."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fl_rescaled.algorithm import Run
from fl_rescaled.manager import Completion

from .base import AsyncStrategy


@dataclass
class MinibatchState:
    """The running sum of this round's gradients and the workers that delivered one."""

    sum: np.ndarray = field(default_factory=lambda: np.zeros(0))
    arrived: set[int] = field(default_factory=set)


class MinibatchSGD(AsyncStrategy):
    """Naive Minibatch SGD: one gradient per worker per round, averaged.

    The server steps with the average of the n gradients once all have arrived and sends the new
    model to everybody; fast workers sit idle until the slowest one finishes (the idle time is
    booked by the client manager). One step of size α per round; memory: one running sum.

    On the wall clock a round waits only for the workers that are online (the mean runs over those
    that delivered); a worker that comes back gets a job on the current model and joins the round.

    Parameters
    ----------
    lr, reply, fraction_evaluate, weighted_by_key, arrayrecord_key, configrecord_key, max_consecutive_rejections
        As in ``AsyncStrategy``; ``lr`` is the step of each round.
    """

    name = "minibatch"
    restarts_at_once = False
    State = MinibatchState

    def init_state(self, run: Run) -> MinibatchState:
        return MinibatchState(np.zeros_like(run.x))

    def check_state(self, state: MinibatchState, n: int, x: np.ndarray) -> None:
        if state.sum.shape != x.shape or not all(0 <= w < n for w in state.arrived):
            raise ValueError("Minibatch's running sum does not fit this run")

    def stored_vectors(self) -> int:
        return int(self.state.sum.size > 0)  # the running sum (once a run has started)

    def on_start(self, run: Run) -> None:
        for worker in range(run.n):
            run.send(worker)

    def _round_done(self, run: Run) -> bool:
        """Every online worker has delivered this round's gradient (wall clock: a worker whose
        node left is not waited for)."""
        arrived = self.state.arrived
        if run.virtual and run.taus.n_active == run.n:  # everyone is online: O(1) per arrival
            return len(arrived) == run.n
        return bool(arrived) and all(w in arrived for w in run.online_workers())

    def on_completion(self, run: Run, comp: Completion) -> None:
        self.state.sum += comp.update
        self.state.arrived.add(comp.worker)
        if self._round_done(run):
            self._close_round(run, comp.worker)
        # else: this worker idles until the round ends

    def on_rejected(self, run: Run, comp: Completion) -> None:
        super().on_rejected(run, comp)
        # The others may all be idle, waiting for the worker that just left.
        if self._round_done(run):
            self._close_round(run, comp.worker)

    def on_joined(self, run: Run, worker: int) -> None:
        if worker not in self.state.arrived:  # a worker that already delivered waits for the next round
            run.send(worker)

    def _close_round(self, run: Run, trigger: int) -> None:
        st = self.state
        run.apply(trigger, st.sum / len(st.arrived), self.lr)
        st.sum[:] = 0
        st.arrived = set()
        for worker in run.online_workers():
            run.send(worker)
