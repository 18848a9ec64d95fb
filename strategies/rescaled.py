"""Rescaled ASGD: plain ASGD whose worker-i stepsize is proportional to its compute time τ_i.

γ_i = α · w_i · τ_i / τ_max. Worker i delivers about τ_max/τ_i gradients per τ_max time units, so
its stepsizes add up to α · w_i per τ_max: every worker pulls with its target weight w_i, and the
method converges to the minimiser of Σ w_i F_i (equal weights by default) instead of Vanilla
ASGD's frequency-weighted objective.

On the wall clock τ_i is the client manager's online estimate of worker i's time per delivery
(or of its reported compute time), τ_max the largest current estimate, and the target weights are
renormalised over the workers that are online and have delivered at least once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fl_rescaled.manager import Completion
from fl_rescaled.stepsizes import check_weights, rescaled_stepsize

from .base import ASGD


class RescaledASGD(ASGD):
    name = "rescaled"

    def __init__(self, lr: float, weights: Sequence[float] | None = None) -> None:
        super().__init__(lr)
        self.weights = None if weights is None else tuple(float(w) for w in weights)

    def describe(self) -> dict:
        return {**super().describe(), "weights": self.weights}

    def on_start(self) -> None:
        if self.weights is not None:
            check_weights(self.weights, self.n)
        super().on_start()

    def stepsize(self, comp: Completion) -> float:
        assert self.manager is not None
        taus = self.manager.tau_estimates()
        if self.manager.clock.virtual:
            return rescaled_stepsize(comp.worker, taus, self.lr, self.weights)
        online = self.manager.online_workers()
        known = [i for i in online if not math.isnan(taus[i])]
        if comp.worker not in known:  # its node was just reported gone: its last word still counts
            known = sorted(known + [comp.worker])
        sub_taus = [taus[i] for i in known]
        w = None
        if self.weights is not None:
            total = sum(self.weights[i] for i in known)
            w = [self.weights[i] / total for i in known]
        return rescaled_stepsize(known.index(comp.worker), sub_taus, self.lr, w)
