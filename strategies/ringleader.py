"""Ringleader ASGD (Maranjyan & Richtárik, 2026): asynchronous, no idle worker, no wasted gradient."""

from __future__ import annotations

from typing import Any

import numpy as np

from fl_rescaled.manager import Completion

from .aggregate import average_of_means
from .base import AsyncStrategy


class RingleaderASGD(AsyncStrategy):
    """Ringleader ASGD: a gradient table, n updates per round, nobody idle.

    The server keeps a table of per-worker gradient sums G_i and counts b_i; all gradients in entry i
    were computed at the model worker i last received. Every update uses the equal-weight average of
    the per-worker means, (1/n) Σ G_l / b_l, with step α/n. Rounds have exactly n updates:

    - Phase 1 (gather): arrivals go into the table, the worker keeps its current model (it is sent
      the same model again). The arrival that makes every b_i ≥ 1 triggers the first update of the
      round and that worker alone gets the new model.
    - Phase 2: each of the other n − 1 workers, on its next arrival, adds its gradient, triggers one
      update and gets the new model. Gradients from workers already served this round go into a
      "next" table (G⁺, b⁺) and keep their model. When everyone has been served, the next table
      becomes the table and phase 1 starts again.

    On the wall clock a worker whose node left is not waited for: phase 1 ends when every online
    worker is in the table, phase 2 serves the online workers, and the mean runs over the table's
    filled rows. A worker that comes back gets a job on the current model.

    Parameters
    ----------
    restart_on_current : bool (default: False)
        Follow the public simulation code instead of the paper: a worker that does not trigger an
        update restarts on the *current* server model.
    lr, reply, fraction_evaluate, weighted_by_key, arrayrecord_key, configrecord_key, max_consecutive_rejections
        As in ``AsyncStrategy``; each update's step is ``lr / n``.
    """

    name = "ringleader"
    restarts_at_once = False

    def __init__(self, *, restart_on_current: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.restart_on_current = bool(restart_on_current)
        self.round_triggers: list[list[int]] = []  # who triggered each update, per round

    def describe(self) -> dict:
        return {**super().describe(), "restart_on_current": self.restart_on_current}

    def stored_vectors(self) -> int:
        return int(np.count_nonzero(self.b) + np.count_nonzero(self.b_next))

    def on_start(self) -> None:
        n, d = self.n, self.x.size
        self.G = np.zeros((n, d), dtype=self.x.dtype)
        self.b = np.zeros(n, dtype=np.int64)
        self.G_next = np.zeros((n, d), dtype=self.x.dtype)
        self.b_next = np.zeros(n, dtype=np.int64)
        self.filled = self.filled_next = 0  # workers with b_i ≥ 1 in each table (O(1) per event)
        self.phase = 1
        self.P: set[int] = set()
        self.max_stored = 0
        for worker in range(n):
            self.submit(worker)

    def _step(self, worker: int) -> None:
        # Equal weights over the table's filled rows: all n unless a node left before delivering.
        est = average_of_means(self.G, self.b, int(np.count_nonzero(self.b)))
        self.apply(worker, est, self.lr / self.n)
        self.round_triggers[-1].append(worker)
        self.submit(worker)

    def _keep_working(self, worker: int) -> None:
        assert self.manager is not None
        if self.restart_on_current:
            self.submit(worker)
        else:
            self.manager.resend(worker)

    def on_completion(self, comp: Completion) -> None:
        assert comp.update is not None
        i = comp.worker
        if self.phase == 1:
            self.G[i] += comp.update
            self.b[i] += 1
            self.filled += int(self.b[i] == 1)
            if self._gathered():
                self._first_update(i)
            else:
                self._keep_working(i)
        elif i in self.P:
            self.G[i] += comp.update
            self.b[i] += 1
            self.filled += int(self.b[i] == 1)
            self.P.discard(i)
            self._step(i)
            if not self.P:
                self._new_round()
        else:
            self.G_next[i] += comp.update
            self.b_next[i] += 1
            self.filled_next += int(self.b_next[i] == 1)
            self._keep_working(i)
        self.max_stored = max(self.max_stored, self.stored_vectors())

    def _gathered(self) -> bool:
        """Phase 1 is over when every online worker has a gradient in the table (wall clock: a
        worker whose node left is not waited for)."""
        assert self.manager is not None
        if self.manager.clock.virtual:  # everyone is online: the running count decides (O(1))
            return self.filled == self.n
        online = self.manager.online_workers()
        return bool(online) and bool(np.all(self.b[online] >= 1))

    def _first_update(self, i: int) -> None:
        assert self.manager is not None
        self.round_triggers.append([])
        self._step(i)
        self.P = set(self.manager.online_workers()) - {i}
        self.phase = 2
        if not self.P:  # a single worker: every round is one update
            self._new_round()

    def on_rejected(self, comp: Completion) -> None:
        super().on_rejected(comp)
        assert self.manager is not None
        if self.manager.books[comp.worker].online:
            return
        # Its node left: the round no longer waits for it.
        if self.phase == 2 and comp.worker in self.P:
            self.P.discard(comp.worker)
            if not self.P:
                self._new_round()
        # Phase 1 closes at the next arrival once every online worker is in the table.

    def _new_round(self) -> None:
        self.G, self.G_next = self.G_next, self.G
        self.b, self.b_next = self.b_next, self.b
        self.filled, self.filled_next = self.filled_next, 0
        self.G_next[:] = 0
        self.b_next[:] = 0
        self.phase = 1
        # Fast workers may already have b_i ≥ 1 for the new round; the round's first update
        # still waits for the next arrival (phase 1 is event-driven).
