"""Vanilla ASGD: plain ASGD with one stepsize for everybody, γ = α · τ_H / (n · τ_max).

Fast workers deliver more often, so they pull harder: the method converges to the frequency-
weighted objective Σ (τ_i⁻¹ / Σ_j τ_j⁻¹) F_i. (α/K per step under harmonic compute times.)
"""

from __future__ import annotations

import math

from fl_rescaled.manager import Completion
from fl_rescaled.stepsizes import vanilla_stepsize

from .base import ASGD


class VanillaASGD(ASGD):
    name = "vanilla"

    def stepsize(self, comp: Completion) -> float:
        assert self.manager is not None
        taus = [t for t in self.manager.tau_estimates() if not math.isnan(t)]
        return vanilla_stepsize(taus, self.lr)
