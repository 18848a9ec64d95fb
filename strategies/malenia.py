"""Malenia SGD (Tyurin & Richtárik, 2023): synchronous rounds, asynchronous gathering."""

from __future__ import annotations

from typing import Any

import numpy as np

from fl_rescaled.manager import Completion

from .aggregate import average_of_means
from .base import AsyncStrategy


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
    gets a job on the current model and is waited for again.

    Parameters
    ----------
    S : float, optional (default: every worker delivers at least one gradient per round)
        Close a round at the first arrival that makes the harmonic mean of the per-worker counts
        exceed S / n (with S < n this is the default rule).
    lr, reply, fraction_evaluate, weighted_by_key, arrayrecord_key, configrecord_key, max_consecutive_rejections
        As in ``AsyncStrategy``; ``lr`` is the step of each round.
    """

    name = "malenia"
    restarts_at_once = False

    def __init__(self, *, S: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if S is not None and not S > 0:
            raise ValueError(f"S must be positive, got {S!r}")
        self.S = S  # None: the "every worker delivered ≥ 1 gradient" rule
        self.rounds = 0

    def describe(self) -> dict:
        return {**super().describe(), "S": self.S}

    def stored_vectors(self) -> int:
        return self.n  # one gradient accumulator per worker

    def on_start(self) -> None:
        self.G = np.zeros((self.n, self.x.size), dtype=self.x.dtype)
        self.B = np.zeros(self.n, dtype=np.int64)
        self.delivered, self.inv_sum = 0, 0.0  # workers with B_i > 0 and Σ 1/B_i over them (O(1) per event)
        self.round_version = 0
        for worker in range(self.n):
            self.submit(worker)

    def _round_done(self) -> bool:
        """Every online worker has delivered (and, with S, the harmonic mean of their counts is
        above S/n). A worker whose node is gone (wall clock) is not waited for."""
        assert self.manager is not None
        if self.manager.clock.virtual:  # everyone is online: the running counts decide
            if self.delivered < self.n:
                return False
            return self.S is None or self.n / self.inv_sum > self.S / self.n
        waited = self.B[self.manager.online_workers()]
        if waited.size == 0 or np.any(waited == 0):
            return False
        if self.S is None:
            return True
        harmonic = 1.0 / np.mean(1.0 / waited)
        return harmonic > self.S / self.n

    def on_completion(self, comp: Completion) -> None:
        assert comp.update is not None and self.manager is not None
        if comp.job.version < self.round_version:
            # A late job of an earlier round (on the wall clock a running job cannot be stopped,
            # only ignored); its worker already holds a job on the current model.
            self.manager.discard(comp.job)
            return
        i = comp.worker
        self.G[i] += comp.update
        self.B[i] += 1
        if self.B[i] == 1:
            self.delivered += 1
        else:
            self.inv_sum -= 1.0 / (self.B[i] - 1)
        self.inv_sum += 1.0 / self.B[i]
        if not self._round_done():
            self.manager.resend(i)  # keep computing on the same x^k
            return
        self._close_round(i)

    def on_rejected(self, comp: Completion) -> None:
        super().on_rejected(comp)
        # A worker that left may have been the last one the round was waiting for.
        if self._round_done():
            self._close_round(comp.worker)

    def _close_round(self, trigger: int) -> None:
        assert self.manager is not None
        # Equal weights over the workers that delivered: all n unless a node left this round.
        g_hat = average_of_means(self.G, self.B, int(np.count_nonzero(self.B)))
        self.apply(trigger, g_hat, self.lr)
        self.rounds += 1
        self.round_version = self.manager.version
        self.G[:] = 0
        self.B[:] = 0
        self.delivered, self.inv_sum = 0, 0.0
        for job in self.manager.pending_jobs():
            self.manager.cancel(job)
        for worker in self.manager.online_workers():
            self.submit(worker)
