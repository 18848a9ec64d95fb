"""Delay-Adaptive ASGD (Mishchenko et al. 2022): plain ASGD whose step shrinks with the delay."""

from __future__ import annotations

from typing import Any

from fl_rescaled.stepsizes import delay_adaptive

from .asgd import ASGD


class DelayAdaptiveASGD(ASGD):
    """Plain ASGD with a step that shrinks with the delay δ = k − v of each reply.

    δ is the number of server updates since the reply's model was sent. The base step γ is
    Vanilla's α · τ_H / (n · τ_max).

    Parameters
    ----------
    rule : str (default: "inverse")
        ``"inverse"`` (the seed paper's analysis): γ / (1 + δ). ``"authors"`` (Mishchenko et al.'s
        code): γ · n / max(n, δ).
    **kwargs
        The options of every strategy: as in ``AsyncStrategy``.
    """

    name = "delay-adaptive"

    def __init__(self, *, rule: str = "inverse", **kwargs: Any) -> None:
        super().__init__(rule=delay_adaptive(rule), **kwargs)
        self.delay_rule = rule

    def describe(self) -> dict:
        return {**super().describe(), "rule": self.delay_rule}
