"""Delay-Adaptive ASGD (Mishchenko et al. 2022): plain ASGD whose step shrinks with the delay.

δ = k − v is the number of server updates since the gradient's model was sent. Default rule
(the seed paper's analysis): γ / (1 + δ); ``rule="authors"`` uses the authors' code instead:
γ · n / max(n, δ). The base γ is Vanilla's α · τ_H / (n · τ_max).
"""

from __future__ import annotations

from fl_rescaled.manager import Completion
from fl_rescaled.stepsizes import DELAY_RULES, delay_adaptive_stepsize

from .base import ASGD


class DelayAdaptiveASGD(ASGD):
    name = "delay-adaptive"

    def __init__(self, lr: float, rule: str = "inverse") -> None:
        super().__init__(lr)
        if rule not in DELAY_RULES:
            raise ValueError(f"unknown delay rule {rule!r}; choose one of {DELAY_RULES}")
        self.rule = rule

    def describe(self) -> dict:
        return {**super().describe(), "rule": self.rule}

    def stepsize(self, comp: Completion) -> float:
        return delay_adaptive_stepsize(self.vanilla_gamma(), comp.delay, self.n, self.rule)
