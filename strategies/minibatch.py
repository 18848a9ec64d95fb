"""Naive Minibatch SGD: every worker computes one gradient per round, then waits."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fl_rescaled.algorithm import Completion, Run

from .base import AsyncStrategy


@dataclass
class MinibatchState:
    """The running sum of this round's updates (weighted: ``FedAvgSync``), its weight, the workers
    that delivered one and (C = N) the workers of the round."""

    sum: np.ndarray = field(default_factory=lambda: np.zeros(0))
    arrived: set[int] = field(default_factory=set)
    count: int = 0  # updates in the sum this round
    weight: float = 0.0  # their total weight (the count when unweighted)
    members: set[int] = field(default_factory=set)  # C = N: the workers online at the round's start, less the dropped


class MinibatchSGD(AsyncStrategy):
    """Naive Minibatch SGD: one gradient per worker per round, averaged; sampled rounds with C < N.

    The server steps with the average of the n gradients once all have arrived and sends the new
    model to everybody; fast workers sit idle until the slowest one finishes (the idle time is
    booked by the client manager). One step of size α per round; memory: one running sum.

    With ``concurrency`` C < N each round draws C workers from the idle, online ones (a lost job's
    slot is drawn again) and closes when C updates are in: synchronous FedAvg's sampled rounds.

    With C = N a round is the workers online at its start. One that comes online during the round
    waits for the next; one that goes offline during it (its job lost) is dropped, and the round
    closes on those left (the mean runs over those that delivered; a round that all left ends with
    no step). A worker of the round whose node comes back before the round closes (a restarted
    SuperNode, or every node after a resumed server on the wall clock) redoes its job. A client
    that keeps failing is set aside and dropped from the round the same way (docs/methods.md,
    "Clients that keep failing"); FedAvg's rounds too.

    Parameters
    ----------
    **kwargs
        The options of every strategy: as in ``AsyncStrategy``; ``lr`` is the step of each round.
    """

    name = "minibatch"
    restarts_at_once = False
    State = MinibatchState
    #: Weight each update by its reply's ``weighted_by_key`` metric (``num-examples``), as FedAvg does.
    weighted = False

    def influence(self, run: Run, worker: int) -> float:
        """1: every worker counts once per round, whatever its speed."""
        del run, worker
        return 1.0

    def init_state(self, run: Run) -> MinibatchState:
        return MinibatchState(np.zeros_like(run.x))

    def check_state(self, state: MinibatchState, n: int, x: np.ndarray) -> None:
        if state.sum.shape != x.shape or not all(0 <= w < n for w in state.arrived | state.members):
            raise ValueError("Minibatch's running sum does not fit this run")

    def stored_vectors(self, state: MinibatchState) -> int:
        return int(state.sum.size > 0)  # the running sum (once a run has started)

    def on_start(self, run: Run) -> None:
        self._new_round(run)

    def _new_round(self, run: Run) -> None:
        if run.concurrency < run.n:
            for _ in range(run.concurrency):
                run.send_next(None)
        else:
            workers = run.online_workers()
            run.strategy_state.members = set(workers)
            for worker in workers:
                run.send(worker)

    def _round_done(self, run: Run) -> bool:
        """C updates are in (sampled rounds), or every worker of the round has delivered, left (its
        job lost: dropped) or is offline (wall clock: a worker whose node left is not waited for)."""
        st = run.strategy_state
        if run.concurrency < run.n:
            return st.count >= run.concurrency
        if run.all_online:  # everyone is online: O(1) per arrival
            return len(st.arrived) == run.n
        return all(w in st.arrived or not run.is_online(w) for w in st.members)

    def on_completion(self, run: Run, comp: Completion) -> None:
        st = run.strategy_state
        if self.weighted:
            w = _weight(comp.metrics.get(self.weighted_by_key))
            st.sum += w * comp.update
            st.weight += w
        else:
            st.sum += comp.update
            st.weight += 1.0
        st.count += 1
        st.arrived.add(comp.worker)
        if self._round_done(run):
            self._close_round(run, comp.worker)
        # else: this worker idles until the round ends

    def on_rejected(self, run: Run, comp: Completion) -> None:
        super().on_rejected(run, comp)  # its slot gets a job again (with C < N, on a worker drawn again)
        if run.concurrency == run.n:
            if not run.is_online(comp.worker):  # (gone: no job again) dropped from the round
                run.strategy_state.members.discard(comp.worker)
            # The others may all be idle, waiting for the worker that just left.
            if self._round_done(run):
                self._close_round(run, comp.worker)

    def on_joined(self, run: Run, worker: int) -> None:
        st = run.strategy_state
        if run.concurrency < run.n:  # (the wall clock's resumed server: as before rounds had members)
            if worker not in st.arrived:
                run.send(worker)
        elif worker in st.members and worker not in st.arrived:  # of this round, its job lost with its node
            run.send(worker)
        elif not st.members:  # no round in progress (nobody was online at the last one's start)
            self._new_round(run)
        # else: it waits for the next round

    def _close_round(self, run: Run, trigger: int) -> None:
        st = run.strategy_state
        if not st.count:  # every worker of the round left before delivering: no step
            pass
        elif self.weighted:
            run.apply(trigger, st.sum / st.weight, self.lr)
        else:
            run.apply(trigger, st.sum / len(st.arrived) if run.concurrency == run.n else st.sum / st.count, self.lr)
        st.sum[:] = 0
        st.arrived, st.count, st.weight, st.members = set(), 0, 0.0, set()
        self._new_round(run)


class FedAvgSync(MinibatchSGD):
    """Synchronous FedAvg on the same engine, for comparisons at equal virtual time or equal work.

    Each round draws C clients (``concurrency``, or ``fraction_train`` as in Flower's FedAvg), waits
    for all of their replies and moves the model to the average of the models they return, weighted
    by ``num-examples`` (x ← x − α · Σ n_i Δ_i / Σ n_i, Δ_i = x − y_i; α = 1 is FedAvg). Its rounds
    last as long as the slowest sampled client: idle time is in the books.

    Parameters
    ----------
    **kwargs
        The options of every strategy: as in ``AsyncStrategy`` (``reply`` defaults to ``"model"``).
    """

    name = "fedavg"
    default_reply = "model"
    weighted = True


def _weight(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else 1.0
