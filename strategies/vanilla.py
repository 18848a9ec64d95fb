"""Vanilla ASGD: plain ASGD with one stepsize for everybody, γ = α · τ_H / (n · τ_max).

Fast workers deliver more often, so they pull harder: the method converges to the frequency-
weighted objective Σ (τ_i⁻¹ / Σ_j τ_j⁻¹) F_i. (α/K per step under harmonic compute times.)
"""

from __future__ import annotations

from fl_rescaled.manager import Completion

from .base import ASGD


class VanillaASGD(ASGD):
    name = "vanilla"

    def stepsize(self, comp: Completion) -> float:
        return self.vanilla_gamma()
