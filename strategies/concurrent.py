"""Concurrent ASGD (Koloskova, Stich & Jaggi, 2022, Alg. 2): random re-assignment with queues."""

from __future__ import annotations

from typing import Any

import numpy as np

from fl_rescaled.manager import Completion

from .base import AsyncStrategy


class ConcurrentASGD(AsyncStrategy):
    """Concurrent ASGD: each new model goes to a worker drawn at random, busy or not.

    τ_C jobs are in flight (all n workers at the start). Each arrival is applied at once with a
    constant step η = α · τ_H / (n · τ_max) (Vanilla's), and the new model is queued on a worker drawn
    uniformly at random, whether or not it is busy; a worker serves its queue first-in first-out and
    idles when the queue is empty. The draws come from a generator seeded by the run seed.

    Parameters
    ----------
    seed : int (default: 0)
        Seeds the random worker draws (non-negative).
    concurrency : int, optional (default: n)
        τ_C, the number of jobs in flight (1 ≤ τ_C ≤ n).
    lr, reply, fraction_evaluate, weighted_by_key, arrayrecord_key, configrecord_key, max_consecutive_rejections
        As in ``AsyncStrategy``.
    """

    name = "concurrent"
    restarts_at_once = False

    def __init__(self, *, seed: int = 0, concurrency: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if concurrency is not None and (isinstance(concurrency, bool) or int(concurrency) != concurrency
                                        or concurrency < 1):
            raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")
        if isinstance(seed, bool) or int(seed) != seed or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed = int(seed)
        self.concurrency = None if concurrency is None else int(concurrency)

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
