"""Rescaled ASGD: plain ASGD whose worker-i stepsize is proportional to its compute time τ_i."""

from __future__ import annotations

import math
from collections.abc import Sequence

from fl_rescaled.manager import Completion
from fl_rescaled.stepsizes import check_weights, rescaled_stepsize

from .base import ASGD


class RescaledASGD(ASGD):
    """Rescaled ASGD (Mahran, Maranjyan & Richtárik, 2026).

    Every reply is applied at once with worker i's own step γ_i = α · w_i · τ_i / τ_max, and the
    new model goes back to that worker. Worker i delivers about τ_max / τ_i replies per τ_max time
    units, so its steps add up to α · w_i per τ_max whatever its speed: the method converges to the
    minimiser of Σ w_i F_i (equal weights by default) instead of plain ASGD's frequency-weighted
    objective Σ (τ_i⁻¹ / Σ_j τ_j⁻¹) F_i.

    On the virtual clock τ_i is the delay model's mean; on the wall clock it is the client
    manager's online estimate of worker i's time per delivery (or of its reported compute time),
    τ_max the largest current estimate, and the weights are renormalised over the workers that
    are online (whether or not they have delivered yet, so the first replies of a run take steps
    of α · w_i, not the larger share of the few workers heard from so far).

    With ``reply="model"`` (an unchanged FedAvg ClientApp that returns its trained model) the
    same weights are applied to the pseudo-gradients Δ_i = x_sent − y_i, so fast clients still
    pull no harder than slow ones. What it converges to: with H local SGD steps at rate η on
    F_i(x) = a_i ‖x − b_i‖², Δ_i = c_i (x − b_i) with c_i = 1 − (1 − 2 η a_i)^H, and the fixed point
    is Σ w_i c_i b_i / Σ w_i c_i. With equal curvature (all c_i equal) that is the equal-weight
    point Σ w_i b_i; otherwise the c_i are the local-steps drift that FedAvg has too (clients with
    more curvature pull harder after several local steps), which vanishes as η H → 0.

    Parameters
    ----------
    weights : sequence of float, optional (default: 1/n each)
        The target mix w_i (non-negative, summing to 1), one per partition: the run then needs
        the partition query (``fl_rescaled.add_partition_query`` in the ClientApp).
    lr, reply, jobs_per_node, fraction_evaluate, weighted_by_key, arrayrecord_key, configrecord_key, max_consecutive_rejections
        As in ``AsyncStrategy`` (``reply`` defaults to ``"gradient"``).
    """

    name = "rescaled"

    def __init__(self, *, weights: Sequence[float] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.weights = None if weights is None else tuple(float(w) for w in weights)
        if self.weights is not None:
            check_weights(self.weights, len(self.weights))

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
        # Weights over the online workers, whether or not they have delivered yet (renormalising
        # over the k that have would give the first replies steps of α/1, α/2, ...: about
        # α · ln n in all before the slow workers report). τ_max over the known estimates.
        online = self.manager.online_workers()
        if comp.worker not in online:  # its node was just reported gone: its last word still counts
            online = sorted(online + [comp.worker])
        # A worker not heard from yet counts in the weights but not in τ_max (its τ stands in as
        # the smallest known one).
        floor = min(taus[i] for i in online if not math.isnan(taus[i]))
        sub_taus = [floor if math.isnan(taus[i]) else taus[i] for i in online]
        w = None
        if self.weights is not None:
            total = sum(self.weights[i] for i in online)
            w = [self.weights[i] / total for i in online]
        return rescaled_stepsize(online.index(comp.worker), sub_taus, self.lr, w)
