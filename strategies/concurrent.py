"""Concurrent ASGD (Koloskova, Stich & Jaggi, 2022, Alg. 2): random re-assignment with queues.

τ_C jobs are in flight (all n workers at the start). Each arrival is applied at once with a
constant step η = α · τ_H / (n · τ_max) (Vanilla's), and the new model is queued on a worker drawn
uniformly at random, whether or not it is busy; a worker serves its queue first-in first-out and
idles when the queue is empty. The draws come from a generator seeded by the run seed.
"""

from __future__ import annotations

import numpy as np

from fl_rescaled.manager import Completion

from .base import AsyncStrategy


class ConcurrentASGD(AsyncStrategy):
    name = "concurrent"

    def __init__(self, lr: float, seed: int = 0, concurrency: int | None = None) -> None:
        super().__init__(lr)
        self.seed = int(seed)
        self.concurrency = concurrency

    def describe(self) -> dict:
        return {**super().describe(), "seed": self.seed, "concurrency": self.concurrency}

    def on_start(self) -> None:
        self.rng = np.random.default_rng((self.seed, 0xC0C0))
        tau_c = self.n if self.concurrency is None else int(self.concurrency)
        if not 1 <= tau_c <= self.n:
            raise ValueError(f"concurrency must be in 1..{self.n}")
        starters = range(self.n) if tau_c == self.n else self.rng.choice(self.n, tau_c, replace=False)
        for worker in sorted(int(w) for w in starters):
            self.submit(worker)

    def on_completion(self, comp: Completion) -> None:
        assert comp.update is not None
        self.apply(comp.worker, comp.update, self.vanilla_gamma())
        self.submit(int(self.rng.integers(self.n)))

    def on_rejected(self, comp: Completion) -> None:
        self.submit(int(self.rng.integers(self.n)))
