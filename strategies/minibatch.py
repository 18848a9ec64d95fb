"""Naive Minibatch SGD: every worker computes one gradient per round, then waits.

The server steps with the average of the n gradients once all have arrived and sends the new
model to everybody; fast workers sit idle until the slowest one finishes (the idle time is
booked by the client manager). One step of size α per round; memory: one running sum.
"""

from __future__ import annotations

import numpy as np

from fl_rescaled.manager import Completion

from .base import AsyncStrategy


class MinibatchSGD(AsyncStrategy):
    name = "minibatch"

    def __init__(self, lr: float) -> None:
        super().__init__(lr)
        self.rounds = 0

    def stored_vectors(self) -> int:
        return 1

    def on_start(self) -> None:
        self.sum = np.zeros_like(self.x)
        self.arrived = 0
        for worker in range(self.n):
            self.submit(worker)

    def on_completion(self, comp: Completion) -> None:
        assert comp.update is not None
        self.sum += comp.update
        self.arrived += 1
        if self.arrived < self.n:
            return  # this worker idles until the round ends
        self.apply(comp.worker, self.sum / self.n, self.lr)
        self.rounds += 1
        self.sum[:] = 0
        self.arrived = 0
        for worker in range(self.n):
            self.submit(worker)
