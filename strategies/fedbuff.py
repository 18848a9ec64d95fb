"""FedBuff (Nguyen et al., 2022): buffered asynchronous aggregation of client updates."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fl_rescaled.algorithm import Run
from fl_rescaled.manager import Completion
from fl_rescaled.stepsizes import polynomial

from .base import AsyncStrategy


@dataclass
class FedBuffState:
    """The buffer of (staleness-weighted) client updates and how many it holds."""

    buffer: np.ndarray = field(default_factory=lambda: np.zeros(0))
    count: int = 0


class FedBuff(AsyncStrategy):
    """FedBuff: client updates are buffered; every K of them make one server step.

    A client trains from the model y_0 it received and returns y_Q (what a FedAvg ClientApp does);
    the server adds w(δ) · Δ, with Δ = y_0 − y_Q and the staleness weight w(δ) = 1 / (1 + δ)^p, to a
    buffer. When K updates are in, x ← x − η_g · buffer / K and the buffer is cleared. A client
    that finishes gets the current model at once, so every client is always training. With K = 1,
    p = 0 and gradient replies this is plain ASGD with step η_g.

    Parameters
    ----------
    buffer_size : int (default: 10)
        K, the updates per server step.
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
    default_reply = "model"
    uses_lr = False
    State = FedBuffState

    def __init__(self, *, buffer_size: int = 10, server_lr: float = 1.0, staleness_exponent: float = 0.5,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(buffer_size, bool) or int(buffer_size) != buffer_size or buffer_size < 1:
            raise ValueError(f"buffer_size must be a positive integer, got {buffer_size!r}")
        if not server_lr > 0 or not 0 <= staleness_exponent <= 1:
            raise ValueError("server_lr must be positive and staleness_exponent in [0, 1]")
        self.K = int(buffer_size)
        self.server_lr, self.p = float(server_lr), float(staleness_exponent)
        self.discount = polynomial(self.p)  # w(δ) = 1 / (1 + δ)^p

    def local_lr(self, gamma_v: float, steps: int) -> float:
        """η_l = γ_V · K / (η_g · Q): one server step moves the model like K Vanilla ASGD steps."""
        return gamma_v * self.K / (self.server_lr * steps)

    def describe(self) -> dict:
        return {**super().describe(), "buffer_size": self.K, "server_lr": self.server_lr,
                "staleness_exponent": self.p}

    def init_state(self, run: Run) -> FedBuffState:
        return FedBuffState(np.zeros_like(run.x))

    def check_state(self, state: FedBuffState, n: int, x: np.ndarray) -> None:
        if state.buffer.shape != x.shape or not 0 <= state.count < self.K:
            raise ValueError("FedBuff's buffer does not fit this run")

    def stored_vectors(self) -> int:
        return 1 if self.state.count else 0

    def on_completion(self, run: Run, comp: Completion) -> None:
        st = self.state
        w = 1.0 if self.p == 0 else self.discount(1.0, comp.delay, run.n)
        st.buffer += w * comp.update
        st.count += 1
        if st.count == self.K:
            run.apply(comp.worker, st.buffer, self.server_lr / self.K)
            st.buffer[:] = 0
            st.count = 0
        run.send_next(comp.worker)
