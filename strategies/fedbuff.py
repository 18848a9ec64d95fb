"""FedBuff (Nguyen et al., 2022): buffered asynchronous aggregation of local updates.

A client runs Q local SGD steps from the model y_0 it received and returns Δ = y_0 − y_Q. The
server adds w(δ)·Δ to a buffer, with the staleness weight w(δ) = 1/(1+δ)^p (p = 0 disables it);
when K deltas are in, x ← x − η_g · buffer / K and the buffer is cleared. A client that finishes
gets the current model at once, so every client is always training.

α convention: the local learning rate is η_l = γ_V · K / (η_g · Q) with γ_V = α · τ_H / (n · τ_max),
so each delta moves the model like one Vanilla ASGD step. With Q = 1, K = 1 and p = 0 this *is*
Vanilla ASGD (server lr × local lr = Vanilla's γ).
"""

from __future__ import annotations

import numpy as np

from fl_rescaled.manager import Completion

from .base import AsyncStrategy


class FedBuff(AsyncStrategy):
    name = "fedbuff"

    def __init__(self, lr: float, buffer_size: int = 3, local_steps: int = 1, server_lr: float = 1.0,
                 staleness_exponent: float = 0.5) -> None:
        super().__init__(lr)
        if buffer_size < 1 or local_steps < 1:
            raise ValueError("buffer_size and local_steps must be at least 1")
        if not server_lr > 0 or not 0 <= staleness_exponent <= 1:
            raise ValueError("server_lr must be positive and staleness_exponent in [0, 1]")
        self.K, self.Q = int(buffer_size), int(local_steps)
        self.server_lr, self.p = float(server_lr), float(staleness_exponent)

    def describe(self) -> dict:
        return {**super().describe(), "buffer_size": self.K, "local_steps": self.Q, "server_lr": self.server_lr,
                "staleness_exponent": self.p}

    def stored_vectors(self) -> int:
        return 1 if self.count else 0

    def local_lr(self) -> float:
        return self.vanilla_gamma() * self.K / (self.server_lr * self.Q)

    def job_config(self) -> dict:
        return {"mode": "local", "local-steps": self.Q, "local-lr": self.local_lr(), "prox": 0.0}

    def on_start(self) -> None:
        self.buffer = np.zeros_like(self.x)
        self.count = 0
        self.weight_sum = 0.0
        for worker in range(self.n):
            self.submit(worker)

    def on_completion(self, comp: Completion) -> None:
        assert comp.update is not None
        w = 1.0 if self.p == 0 else (1.0 + comp.delay) ** (-self.p)
        self.buffer += w * comp.update
        self.count += 1
        self.weight_sum += w
        if self.count == self.K:
            booked = self.server_lr * self.local_lr() * self.Q * self.weight_sum / self.K
            self.apply(comp.worker, self.buffer, self.server_lr / self.K, booked=booked)
            self.buffer[:] = 0
            self.count = 0
            self.weight_sum = 0.0
        self.submit(comp.worker)
