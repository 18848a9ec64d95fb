"""Naive Minibatch SGD: every worker computes one gradient per round, then waits."""

from __future__ import annotations

from typing import Any

import numpy as np

from fl_rescaled.manager import Completion

from .base import AsyncStrategy


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

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rounds = 0

    def stored_vectors(self) -> int:
        return 1

    def on_start(self) -> None:
        self.sum = np.zeros_like(self.x)
        self.arrived: set[int] = set()
        for worker in range(self.n):
            self.submit(worker)

    def _round_done(self) -> bool:
        """Every online worker has delivered this round's gradient (wall clock: a worker whose
        node left is not waited for)."""
        assert self.manager is not None
        if self.manager.clock.virtual:  # everyone is online: O(1) per arrival
            return len(self.arrived) == self.n
        return bool(self.arrived) and all(w in self.arrived for w in self.manager.online_workers())

    def on_completion(self, comp: Completion) -> None:
        assert comp.update is not None
        self.sum += comp.update
        self.arrived.add(comp.worker)
        if self._round_done():
            self._close_round(comp.worker)
        # else: this worker idles until the round ends

    def on_rejected(self, comp: Completion) -> None:
        super().on_rejected(comp)
        # The others may all be idle, waiting for the worker that just left.
        if self._round_done():
            self._close_round(comp.worker)

    def on_worker_joined(self, worker: int) -> None:
        if worker not in self.arrived:  # a worker that already delivered waits for the next round
            self.submit(worker)

    def _close_round(self, trigger: int) -> None:
        assert self.manager is not None
        self.apply(trigger, self.sum / len(self.arrived), self.lr)
        self.rounds += 1
        self.sum[:] = 0
        self.arrived = set()
        for worker in self.manager.online_workers():
            self.submit(worker)
