"""Rescaled ASGD: plain ASGD whose worker-i stepsize is proportional to its compute time τ_i."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fl_rescaled.stepsizes import check_weights, rescaled

from .asgd import ASGD


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
    of α · w_i, not the larger share of the few workers heard from so far). The rule is
    ``fl_rescaled.stepsizes.rescaled``.

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

    def __init__(self, *, weights: Sequence[float] | None = None, **kwargs: Any) -> None:
        super().__init__(rule=rescaled(), **kwargs)
        self.weights = None if weights is None else check_weights(weights, len(weights))

    def target_weights(self) -> Sequence[float] | None:
        return self.weights

    def describe(self) -> dict:
        return {**super().describe(), "weights": self.weights}
