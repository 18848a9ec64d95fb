"""Concurrent ASGD (Koloskova, Stich & Jaggi, 2022, Alg. 2): random re-assignment with queues."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_rescaled.algorithm import Run
from fl_rescaled.manager import Completion

from .base import AsyncStrategy


@dataclass
class ConcurrentState:
    """The generator of the random worker draws."""

    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))


class ConcurrentASGD(AsyncStrategy):
    """Concurrent ASGD: each new model goes to a worker drawn at random, busy or not.

    τ_C jobs are in flight (all n workers at the start). Each arrival is applied at once with a
    constant step η = α · τ_H / (n · τ_max) (Vanilla's), and the new model is queued on a worker drawn
    uniformly at random (among the active ones: not a node that left or a worker set aside), whether
    or not it is busy; a worker serves its queue first-in first-out and
    idles when the queue is empty. The draws come from a generator seeded by the run seed.

    Parameters
    ----------
    seed : int, optional (default: the run's seed)
        Seeds the random worker draws (non-negative).
    concurrency : int, optional (default: n)
        τ_C, the number of jobs in flight (1 ≤ τ_C ≤ n).
    lr, reply, fraction_evaluate, weighted_by_key, arrayrecord_key, configrecord_key, max_consecutive_rejections
        As in ``AsyncStrategy``.
    """

    name = "concurrent"
    restarts_at_once = False
    State = ConcurrentState

    def __init__(self, *, seed: int | None = None, concurrency: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if concurrency is not None and (isinstance(concurrency, bool) or int(concurrency) != concurrency
                                        or concurrency < 1):
            raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")
        if seed is not None and (isinstance(seed, bool) or int(seed) != seed or seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed = None if seed is None else int(seed)
        self.concurrency = None if concurrency is None else int(concurrency)

    def describe(self) -> dict:
        return {**super().describe(), "seed": self.seed, "concurrency": self.concurrency}

    def init_state(self, run: Run) -> ConcurrentState:
        return ConcurrentState(np.random.default_rng((run.seed if self.seed is None else self.seed, 0xC0C0)))

    def on_start(self, run: Run) -> None:
        rng, n = self.state.rng, run.n
        tau_c = n if self.concurrency is None else int(self.concurrency)
        if not 1 <= tau_c <= n:
            raise ValueError(f"concurrency must be in 1..{n}")
        starters = range(n) if tau_c == n else rng.choice(n, tau_c, replace=False)
        for worker in sorted(int(w) for w in starters):
            run.send(worker)

    def on_completion(self, run: Run, comp: Completion) -> None:
        run.apply(comp.worker, comp.update, self.vanilla_gamma(self.lr, run))
        run.send(self._draw(run))

    def on_rejected(self, run: Run, comp: Completion) -> None:
        run.send(self._draw(run))

    def _draw(self, run: Run) -> int:
        """A worker drawn uniformly at random among the active ones (all, unless one was set aside)."""
        active = [w for w in range(run.n) if run.taus.active[w]] if run.taus.n_active < run.n else []
        if not active:
            return int(self.state.rng.integers(run.n))
        return active[int(self.state.rng.integers(len(active)))]
