"""Malenia SGD (Tyurin & Richtárik, 2023): synchronous rounds, asynchronous gathering."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_rescaled.algorithm import Completion, Run

from .aggregate import average_of_means
from .base import AsyncStrategy
from .checks import every_worker_each_round


@dataclass
class MaleniaState:
    """The round's per-worker gradient sums G_i and counts B_i, and the round's model version."""

    G: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    B: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    delivered: int = 0  # workers with B_i > 0 ...
    inv_sum: float = 0.0  # ... and Σ 1/B_i over them (the stopping rule in O(1) per event)
    round_version: int = 0


class MaleniaSGD(AsyncStrategy):
    """Malenia SGD: rounds whose gradients are gathered asynchronously.

    During round k every worker keeps computing gradients at the same x^k; the server sums them per
    worker (G_i, B_i). The round closes at the first arrival that makes the harmonic mean of the
    counts exceed S/n (by default: as soon as every worker has delivered at least one gradient). The
    step uses the equal-weight average of the per-worker means, (1/n) Σ G_i / B_i, which is unbiased
    for (1/n) Σ F_i; then every worker is restarted on x^{k+1} and the jobs still running are
    cancelled (their work is booked as discarded). One step of size α per round.

    On the wall clock a round waits only for the workers that are online: a worker whose node left
    is not waited for, the mean runs over the workers that delivered, and a worker that comes back
    gets a job on the current model and is waited for again. A client that keeps failing is set
    aside and the round closes without it (docs/methods.md, "Clients that keep failing").

    Parameters
    ----------
    S : float, optional (default: every worker delivers at least one gradient per round)
        Close a round at the first arrival that makes the harmonic mean of the per-worker counts
        exceed S / n (with S < n this is the default rule).
    **kwargs
        The options of every strategy: as in ``AsyncStrategy``; ``lr`` is the step of each round.
    """

    name = "malenia"
    restarts_at_once = False
    State = MaleniaState

    def __init__(self, *, S: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if S is not None and not S > 0:
            raise ValueError(f"S must be positive, got {S!r}")
        self.S = S  # None: the "every worker delivered ≥ 1 gradient" rule

    def influence(self, run: Run, worker: int) -> float:
        """1: every worker counts once per round, whatever its speed."""
        del run, worker
        return 1.0

    def describe(self) -> dict:
        return {**super().describe(), "S": self.S}

    def init_state(self, run: Run) -> MaleniaState:
        every_worker_each_round(self, run)
        return MaleniaState(np.zeros((run.n, run.x.size), dtype=run.x.dtype), np.zeros(run.n, dtype=np.int64))

    def check_state(self, state: MaleniaState, n: int, x: np.ndarray) -> None:
        if state.G.shape != (n, x.size) or state.B.shape != (n,) or (state.B < 0).any():
            raise ValueError("Malenia's gradient sums do not fit this run")

    def stored_vectors(self, state: MaleniaState) -> int:
        return len(state.B)  # one gradient accumulator per worker

    def on_start(self, run: Run) -> None:
        for worker in run.online_workers():
            run.send(worker)

    def _round_done(self, run: Run) -> bool:
        """Every online worker has delivered (and, with S, the harmonic mean of their counts is
        above S/n). A worker whose node is gone (wall clock) is not waited for."""
        st, n = run.strategy_state, run.n
        if run.all_online:  # everyone is online: the running counts decide
            if st.delivered < n:
                return False
            return self.S is None or n / st.inv_sum > self.S / n
        waited = st.B[run.online_workers()]
        if waited.size == 0 or np.any(waited == 0):
            return False
        if self.S is None:
            return True
        harmonic = 1.0 / np.mean(1.0 / waited)
        return harmonic > self.S / n

    def on_completion(self, run: Run, comp: Completion) -> None:
        st = run.strategy_state
        if comp.job.version < st.round_version:
            # A late job of an earlier round (on the wall clock a running job cannot be stopped,
            # only ignored); its worker already holds a job on the current model.
            run.discard(comp.job)
            return
        i = comp.worker
        st.G[i] += comp.update
        st.B[i] += 1
        if st.B[i] == 1:
            st.delivered += 1
        else:
            st.inv_sum -= 1.0 / (st.B[i] - 1)
        st.inv_sum += 1.0 / st.B[i]
        if not self._round_done(run):
            run.resend(comp.job)  # keep computing on the same x^k
            return
        self._close_round(run, i)

    def on_rejected(self, run: Run, comp: Completion) -> None:
        super().on_rejected(run, comp)
        # A worker that left may have been the last one the round was waiting for.
        if self._round_done(run):
            self._close_round(run, comp.worker)

    def _close_round(self, run: Run, trigger: int) -> None:
        st = run.strategy_state
        # Equal weights over the workers that delivered: all n unless a node left this round.
        g_hat = average_of_means(st.G, st.B, int(np.count_nonzero(st.B)))
        run.apply(trigger, g_hat, self.lr)
        st.round_version = run.version
        st.G[:] = 0
        st.B[:] = 0
        st.delivered, st.inv_sum = 0, 0.0
        run.cancel_all()
        for worker in run.online_workers():
            run.send(worker)
