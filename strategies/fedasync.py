"""FedAsync (Xie, Koyejo & Gupta, 2019): asynchronous mixing of locally trained models."""

from __future__ import annotations

from typing import Any

from fl_rescaled.algorithm import Completion, Run
from fl_rescaled.stepsizes import fedasync_staleness

from .base import AsyncStrategy


class FedAsync(AsyncStrategy):
    """FedAsync: every returned model is mixed into the global one at once.

    A client trains from the model x_τ it received and returns y (what a FedAvg ClientApp does).
    The server mixes it in with a staleness-discounted weight α_t = mixing · s(t − τ), where t − τ
    is the number of server updates since x_τ was sent: x_t = (1 − α_t) x_{t−1} + α_t y, and sends
    x_t back to that client. Fast clients mix in more often, so the model leans toward their data
    (the frequency-weighted objective, as plain ASGD).

    Parameters
    ----------
    mixing : float (default: 0.6)
        α, the mixing weight of a fresh model (0 < α ≤ 1).
    staleness : str (default: "polynomial")
        The discount s: ``"constant"`` (1), ``"polynomial"`` ((t − τ + 1)^(−a)) or ``"hinge"``
        (1 when t − τ ≤ b, else 1 / (a (t − τ − b) + 1)).
    a : float (default: 0.5)
        Exponent (polynomial) or slope (hinge) of the discount.
    b : int (default: 4)
        Staleness the hinge discount tolerates.
    reply : str (default: "model")
        As in ``AsyncStrategy``. With ``"gradient"`` the reply is taken as the client's update
        Δ = x_τ − y itself.
    **kwargs
        The options of every strategy: as in ``AsyncStrategy``. ``lr`` is not used: the clients'
        own learning rate sets the size of their updates (send it in ``train_config``).
    """

    name = "fedasync"
    dp_release = "sum"
    default_reply = "model"
    uses_lr = False

    def __init__(self, *, mixing: float = 0.6, staleness: str = "polynomial", a: float = 0.5, b: int = 4,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0 < mixing <= 1:
            raise ValueError(f"mixing must be in (0, 1], got {mixing!r}")
        self.discount = fedasync_staleness(staleness, a, b)  # validates the name and a, b
        self.mixing = float(mixing)
        self.staleness, self.a, self.b = staleness, float(a), int(b)

    def local_lr(self, gamma_v: float, steps: int, n: int = 1) -> float:
        """η = γ_V / (mixing · H): one update moves the model like one Vanilla ASGD step."""
        del n
        return gamma_v / (self.mixing * steps)

    def describe(self) -> dict:
        return {**super().describe(), "mixing": self.mixing, "staleness": self.staleness, "a": self.a, "b": self.b}

    def influence(self, run: Run, worker: int) -> float:
        """The mixing weight at the worker's typical staleness, per delivery period: α(δ_i) / p_i."""
        taus = run.periods
        return self.discount(self.mixing, taus.expected_delay(worker), run.n) / taus.period(worker)

    def on_completion(self, run: Run, comp: Completion) -> None:
        alpha_t = self.discount(self.mixing, comp.delay, run.n)  # mixing · s(t − τ)
        x_tau = run.model_of(comp.job)
        # x ← (1 − α_t) x + α_t y  ==  x − α_t · (x − x_τ + Δ), with Δ = x_τ − y the update
        run.apply(comp.worker, (run.x - x_tau) + comp.update, alpha_t)
        run.send_next(comp.worker)
