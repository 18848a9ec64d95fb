"""Concurrent ASGD (Koloskova, Stich & Jaggi, 2022, Alg. 2): random re-assignment with queues."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_rescaled.algorithm import Completion, Run

from .base import _VANILLA, AsyncStrategy


@dataclass
class ConcurrentState:
    """The generator of the random worker draws."""

    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))


class ConcurrentASGD(AsyncStrategy):
    """Concurrent ASGD: each new model goes to a worker drawn at random, busy or not.

    τ_C jobs are in flight (the common ``concurrency``; all n workers by default). Each arrival is applied at once with a
    constant step η = α · τ_H / (n · τ_max) (Vanilla's), and the new model is queued on a worker drawn
    uniformly at random (among the active ones: not a node that left or a worker set aside), whether
    or not it is busy; a worker serves its queue first-in first-out and
    idles when the queue is empty. The draws come from a generator seeded by the run seed.

    Parameters
    ----------
    seed : int, optional (default: the run's seed)
        Seeds the random worker draws (non-negative).
    **kwargs
        The options of every strategy: as in ``AsyncStrategy``.
    """

    name = "concurrent"
    dp_release = "sum"
    restarts_at_once = False
    State = ConcurrentState

    def influence(self, run: Run, worker: int) -> float:
        """1: a freed job goes to a worker drawn uniformly, so every worker delivers about as often."""
        del run, worker
        return 1.0

    def __init__(self, *, seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if seed is not None and (isinstance(seed, bool) or int(seed) != seed or seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed = None if seed is None else int(seed)

    def describe(self) -> dict:
        return {**super().describe(), "seed": self.seed}

    def init_state(self, run: Run) -> ConcurrentState:
        return ConcurrentState(np.random.default_rng((run.seed if self.seed is None else self.seed, 0xC0C0)))

    def on_start(self, run: Run) -> None:
        rng, n, tau_c = run.strategy_state.rng, run.n, run.concurrency
        starters = range(n) if tau_c == n else rng.choice(n, tau_c, replace=False)
        for worker in sorted(int(w) for w in starters):
            run.send(worker)

    def on_completion(self, run: Run, comp: Completion) -> None:
        run.apply(comp.worker, comp.update, _VANILLA(self.lr, 0, run.compute_times, 0))
        run.send(self._draw(run))

    def on_rejected(self, run: Run, comp: Completion) -> None:
        run.send(self._draw(run))

    def _draw(self, run: Run) -> int:
        """A worker drawn uniformly at random among the active ones (all, unless one was set aside)."""
        table = run.compute_times
        active = [w for w in range(run.n) if table.active[w]] if table.n_active < run.n else []
        if not active:
            return int(run.strategy_state.rng.integers(run.n))
        return active[int(run.strategy_state.rng.integers(len(active)))]
