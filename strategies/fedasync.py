"""FedAsync (Xie, Koyejo & Gupta, 2019): asynchronous mixing of locally trained models.

A client trains H local SGD steps from the model x_τ it received, on F_i(y) + (ρ/2)‖y − x_τ‖²,
and returns the delta Δ = x_τ − y_H. The server mixes the new model in with a staleness-discounted
weight, α_t = mixing · s(t − τ):  x_t = (1 − α_t) x_{t−1} + α_t (x_τ − Δ), then sends x_t back to
that client. Staleness functions s: constant, polynomial (t − τ + 1)^(−a), hinge (1 if t − τ ≤ b,
else 1/(a(t − τ − b) + 1)).

α convention: the local learning rate is η = γ_V / (mixing · H) with γ_V = α · τ_H / (n · τ_max)
(Vanilla's step), so with s ≡ 1 the gradient part of every update moves the model as much as a
Vanilla ASGD step. The booked stepsize of an update is α_t · η · H.
"""

from __future__ import annotations

from fl_rescaled.manager import Completion

from .base import AsyncStrategy

STALENESS = ("constant", "polynomial", "hinge")


def staleness_weight(kind: str, staleness: int, a: float = 0.5, b: int = 4) -> float:
    """s(t − τ) of FedAsync."""
    if staleness < 0:
        raise ValueError("staleness must be non-negative")
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return float((staleness + 1) ** (-a))
    if kind == "hinge":
        return 1.0 if staleness <= b else 1.0 / (a * (staleness - b) + 1.0)
    raise ValueError(f"unknown staleness function {kind!r}; choose one of {STALENESS}")


class FedAsync(AsyncStrategy):
    name = "fedasync"

    def __init__(self, lr: float, mixing: float = 0.6, local_steps: int = 1, prox: float = 0.0,
                 staleness: str = "polynomial", a: float = 0.5, b: int = 4) -> None:
        super().__init__(lr)
        if not 0 < mixing <= 1:
            raise ValueError("mixing must be in (0, 1]")
        if local_steps < 1:
            raise ValueError("local_steps must be at least 1")
        staleness_weight(staleness, 0, a, b)  # validates the name
        self.mixing, self.local_steps, self.prox = float(mixing), int(local_steps), float(prox)
        self.staleness, self.a, self.b = staleness, float(a), int(b)

    def describe(self) -> dict:
        return {**super().describe(), "mixing": self.mixing, "local_steps": self.local_steps, "prox": self.prox,
                "staleness": self.staleness, "a": self.a, "b": self.b}

    def local_lr(self) -> float:
        return self.vanilla_gamma() / (self.mixing * self.local_steps)

    def job_config(self) -> dict:
        return {"mode": "local", "local-steps": self.local_steps, "local-lr": self.local_lr(), "prox": self.prox}

    def on_start(self) -> None:
        for worker in range(self.n):
            self.submit(worker)

    def on_completion(self, comp: Completion) -> None:
        assert comp.update is not None and self.manager is not None
        alpha_t = self.mixing * staleness_weight(self.staleness, comp.delay, self.a, self.b)
        x_tau = self.manager.model_of(comp.job)
        # x ← (1 − α_t) x + α_t (x_τ − Δ)  ==  x − α_t · (x − x_τ + Δ)
        self.apply(comp.worker, (self.x - x_tau) + comp.update, alpha_t,
                   booked=alpha_t * self.local_lr() * self.local_steps)
        self.submit(comp.worker)
