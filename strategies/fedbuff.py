"""FedBuff (Nguyen et al., 2022): buffered asynchronous aggregation of client updates."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_rescaled.algorithm import Completion, Run
from fl_rescaled.stepsizes import polynomial

from .base import AsyncStrategy

log = logging.getLogger("flwr.fl_rescaled")

#: The largest buffer FedBuff picks by itself (the FedBuff paper's K, with a thousand jobs in flight).
MAX_DEFAULT_BUFFER = 10


def default_buffer(in_flight: int) -> int:
    """FedBuff's K when none is given, for ``in_flight`` jobs in flight: ⌈C / 2⌉, at least 2, at most
    ``MAX_DEFAULT_BUFFER``, and never more than C."""
    return max(1, min(in_flight, MAX_DEFAULT_BUFFER, max(2, math.ceil(in_flight / 2))))


@dataclass
class FedBuffState:
    """The buffer of (staleness-weighted) client updates, how many it holds, and its size K."""

    buffer: np.ndarray = field(default_factory=lambda: np.zeros(0))
    count: int = 0
    size: int = 1


class FedBuff(AsyncStrategy):
    """FedBuff: client updates are buffered; every K of them make one server step.

    A client trains from the model y_0 it received and returns y_Q (what a FedAvg ClientApp does);
    the server adds w(δ) · Δ, with Δ = y_0 − y_Q and the staleness weight w(δ) = 1 / (1 + δ)^p, to a
    buffer. When K updates are in, x ← x − η_g · buffer / K and the buffer is cleared. A client
    that finishes gets the current model at once, so every client is always training. With K = 1,
    p = 0 and gradient replies this is plain ASGD with step η_g.

    Parameters
    ----------
    buffer_size : int, optional (default: from the jobs in flight, C)
        K, the updates per server step. Default: ⌈C / 2⌉, at least 2, at most 10 and at most C
        (``default_buffer``), with C the jobs the run keeps in flight, known at ``start``
        (``concurrency`` or ``fraction_train`` × the nodes; × ``jobs_per_node`` when every node
        trains). Why: K replies from a population that keeps C jobs in flight arrive about C / K
        times per round's worth of C trainings. A buffer larger than C makes an update wait for
        replies to jobs not yet sent: with 2 of 10 nodes training, the old default of 10 made one
        update in 10 trainings and reached 0.71 where FedAvg reached 0.92 (the example app, 40
        trainings); a start warning now says so. A buffer of 1 or 2 with many jobs in flight makes
        several steps from replies computed on the same model, which overshoots when the clients
        finish together (identical speeds): 12 of 50 at a time, K = 2 reached 0.49. Half of C
        sits between: measured on the example app (``docs/population.md``). ``start`` warns when a
        given K is above C; K = C (one update per round's worth of replies, FedAvg's pace) is
        not warned about: with 5 nodes all training at one speed it did best (0.835, against 0.787
        for the default K = 3, 5 seeds).
    server_lr : float (default: 1.0)
        η_g, the server's learning rate.
    staleness_exponent : float (default: 0.5)
        p in w(δ) = 1 / (1 + δ)^p, in [0, 1]; 0 turns the discount off.
    reply : str (default: "model")
        As in ``AsyncStrategy``. With ``"gradient"`` the reply is taken as Δ itself.
    **kwargs
        The options of every strategy: as in ``AsyncStrategy``. ``lr`` is not used: the clients'
        own learning rate sets the size of their updates (send it in ``train_config``).
    """

    name = "fedbuff"
    dp_release = "sum"
    default_reply = "model"
    uses_lr = False
    State = FedBuffState

    def __init__(self, *, buffer_size: int | None = None, server_lr: float = 1.0, staleness_exponent: float = 0.5,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if buffer_size is not None and (isinstance(buffer_size, bool) or not isinstance(buffer_size, (int, float))
                                        or int(buffer_size) != buffer_size or buffer_size < 1):
            raise ValueError(f"buffer_size must be a positive integer, got {buffer_size!r}")
        if not server_lr > 0 or not 0 <= staleness_exponent <= 1:
            raise ValueError("server_lr must be positive and staleness_exponent in [0, 1]")
        self.buffer_size = None if buffer_size is None else int(buffer_size)
        self.server_lr, self.p = float(server_lr), float(staleness_exponent)
        self.discount = polynomial(self.p)  # w(δ) = 1 / (1 + δ)^p

    def in_flight(self, n: int) -> int:
        """The jobs a run of ``n`` workers keeps in flight: C (× ``jobs_per_node`` when every node trains)."""
        c = self.population.slots(n)
        return c * self.jobs_per_node if c == n else c

    def buffer_for(self, n: int) -> int:
        """K for a run of ``n`` workers: ``buffer_size``, else ``default_buffer`` of its jobs in flight."""
        return self.buffer_size if self.buffer_size is not None else default_buffer(self.in_flight(n))

    def local_lr(self, gamma_v: float, steps: int, n: int = 1) -> float:
        """η_l = γ_V · K / (η_g · Q): one server step moves the model like K Vanilla ASGD steps."""
        return gamma_v * self.buffer_for(n) / (self.server_lr * steps)

    def describe(self) -> dict:
        return {**super().describe(), "buffer_size": self.buffer_size, "server_lr": self.server_lr,
                "staleness_exponent": self.p}

    def init_state(self, run: Run) -> FedBuffState:
        k, c = self.buffer_for(run.n), self.in_flight(run.n)
        if k > c:
            log.warning("FedBuff: a buffer of %d replies is more than the %d jobs in flight, so each update waits "
                        "for replies to jobs not yet sent (one update per %.3g rounds' worth of trainings); "
                        "leave buffer_size out for the default, %d here", k, c, k / c, default_buffer(c))
        return FedBuffState(np.zeros_like(run.x), 0, k)

    def check_state(self, state: FedBuffState, n: int, x: np.ndarray) -> None:
        if state.buffer.shape != x.shape or state.size != self.buffer_for(n) or not 0 <= state.count < state.size:
            raise ValueError("FedBuff's buffer does not fit this run")

    def stored_vectors(self, state: FedBuffState) -> int:
        return 1 if state.count else 0

    def influence(self, run: Run, worker: int) -> float:
        """The staleness weight at the worker's typical staleness (in server steps, one per K replies),
        per delivery period: w(δ_i) / p_i."""
        taus = run.periods
        delay = taus.expected_delay(worker) / run.strategy_state.size
        return (1.0 if self.p == 0 else self.discount(1.0, delay, run.n)) / taus.period(worker)

    def on_completion(self, run: Run, comp: Completion) -> None:
        st = run.strategy_state
        w = 1.0 if self.p == 0 else self.discount(1.0, comp.delay, run.n)
        st.buffer += w * comp.update
        st.count += 1
        if st.count == st.size:
            run.apply(comp.worker, st.buffer, self.server_lr / st.size)
            st.buffer[:] = 0
            st.count = 0
        run.send_next(comp.worker)
