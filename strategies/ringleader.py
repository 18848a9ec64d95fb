"""Ringleader ASGD (Maranjyan & Richtárik, 2026): asynchronous, no idle worker, no wasted gradient."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_rescaled.algorithm import Completion, Run

from .aggregate import average_of_means
from .base import AsyncStrategy
from .checks import every_worker_each_round


@dataclass
class RingleaderState:
    """The gradient table (G_i, b_i) and the next round's (G⁺_i, b⁺_i), the phase, the workers still
    to serve this round (P), and who triggered each update of each round."""

    G: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    b: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    G_next: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    b_next: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    filled: int = 0  # workers with b_i ≥ 1 in each table (O(1) per event)
    filled_next: int = 0
    phase: int = 1
    P: set[int] = field(default_factory=set)
    round_triggers: list[list[int]] = field(default_factory=list)


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
    filled rows. A worker that comes back gets a job on the current model. A client that keeps
    failing is set aside, and no round waits for it (docs/methods.md, "Clients that keep failing").

    Parameters
    ----------
    restart_on_current : bool (default: False)
        Follow the public simulation code instead of the paper: a worker that does not trigger an
        update restarts on the *current* server model.
    **kwargs
        The options of every strategy: as in ``AsyncStrategy``; each update's step is ``lr / n``.
    """

    name = "ringleader"
    restarts_at_once = False
    State = RingleaderState

    def influence(self, run: Run, worker: int) -> float:
        """1: every worker counts once per round, whatever its speed."""
        del run, worker
        return 1.0

    def __init__(self, *, restart_on_current: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.restart_on_current = bool(restart_on_current)

    def describe(self) -> dict:
        return {**super().describe(), "restart_on_current": self.restart_on_current}

    def init_state(self, run: Run) -> RingleaderState:
        every_worker_each_round(self, run)
        n, d, dtype = run.n, run.x.size, run.x.dtype
        return RingleaderState(np.zeros((n, d), dtype), np.zeros(n, np.int64), np.zeros((n, d), dtype),
                               np.zeros(n, np.int64))

    def check_state(self, state: RingleaderState, n: int, x: np.ndarray) -> None:
        shapes = (state.G.shape, state.G_next.shape, state.b.shape, state.b_next.shape)
        if shapes != ((n, x.size), (n, x.size), (n,), (n,)) or state.phase not in (1, 2) \
                or not all(0 <= w < n for w in state.P):
            raise ValueError("Ringleader's gradient tables do not fit this run")

    def stored_vectors(self, state: RingleaderState) -> int:
        return int(np.count_nonzero(state.b) + np.count_nonzero(state.b_next))

    def on_start(self, run: Run) -> None:
        for worker in run.online_workers():
            run.send(worker)

    def _step(self, run: Run, worker: int) -> None:
        st = run.strategy_state
        # Equal weights over the table's filled rows: all n unless a node left before delivering.
        est = average_of_means(st.G, st.b, int(np.count_nonzero(st.b)))
        run.apply(worker, est, self.lr / run.n)
        st.round_triggers[-1].append(worker)
        run.send(worker)

    def _keep_working(self, run: Run, comp: Completion) -> None:
        if self.restart_on_current:
            run.send(comp.worker)
        else:
            run.resend(comp.job)

    def on_completion(self, run: Run, comp: Completion) -> None:
        st = run.strategy_state
        i = comp.worker
        if st.phase == 1:
            st.G[i] += comp.update
            st.b[i] += 1
            st.filled += int(st.b[i] == 1)
            if self._gathered(run):
                self._first_update(run, i)
            else:
                self._keep_working(run, comp)
        elif i in st.P:
            st.G[i] += comp.update
            st.b[i] += 1
            st.filled += int(st.b[i] == 1)
            st.P.discard(i)
            self._step(run, i)
            if not st.P:
                self._new_round(st)
        else:
            st.G_next[i] += comp.update
            st.b_next[i] += 1
            st.filled_next += int(st.b_next[i] == 1)
            self._keep_working(run, comp)

    def _gathered(self, run: Run) -> bool:
        """Phase 1 is over when every online worker has a gradient in the table (wall clock: a
        worker whose node left is not waited for)."""
        st = run.strategy_state
        if run.all_online:  # everyone is online: the running count decides (O(1))
            return st.filled == run.n
        online = run.online_workers()
        return bool(online) and bool(np.all(st.b[online] >= 1))

    def _first_update(self, run: Run, i: int) -> None:
        st = run.strategy_state
        st.round_triggers.append([])
        self._step(run, i)
        st.P = set(run.online_workers()) - {i}
        st.phase = 2
        if not st.P:  # a single worker: every round is one update
            self._new_round(st)

    def on_rejected(self, run: Run, comp: Completion) -> None:
        super().on_rejected(run, comp)
        st = run.strategy_state
        if run.is_online(comp.worker):
            return
        # Its node left: the round no longer waits for it.
        if st.phase == 2 and comp.worker in st.P:
            st.P.discard(comp.worker)
            if not st.P:
                self._new_round(st)
        # Phase 1 closes at the next arrival once every online worker is in the table.

    @staticmethod
    def _new_round(st: RingleaderState) -> None:
        st.G, st.G_next = st.G_next, st.G
        st.b, st.b_next = st.b_next, st.b
        st.filled, st.filled_next = st.filled_next, 0
        st.G_next[:] = 0
        st.b_next[:] = 0
        st.phase = 1
        # Fast workers may already have b_i ≥ 1 for the new round; the round's first update
        # still waits for the next arrival (phase 1 is event-driven).
