"""Rescaled ASGD: plain ASGD whose worker-i stepsize is proportional to its time between deliveries."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fl_rescaled.algorithm import Run
from fl_rescaled.stepsizes import TauTable, check_weights, rescaled

from .asgd import ASGD


#: FedAsync's default mixing weight, whose pace Rescaled ASGD's default α matches for model replies.
FEDASYNC_MIXING = 0.6


class RescaledASGD(ASGD):
    """Rescaled ASGD (Mahran, Maranjyan & Richtárik, 2026), for a population too.

    Every reply is applied at once with worker i's own step γ_i = α · w_i · p_i / p_max, where p_i is
    worker i's mean time between deliveries (p_i = 1 / f_i, f_i its delivery rate) and w_i its
    target weight. Worker i delivers about p_max / p_i replies per p_max time units, so its steps
    add up to α · w_i per p_max whatever its speed or how often it is chosen: the method converges
    to the minimiser of Σ w_i F_i (equal weights by default).

    Why p_i. For small steps the model follows dx/dt = −Σ_i f_i γ_i ∇F_i(x) (client i's replies arrive
    at rate f_i, each a step γ_i), so it settles at the minimiser of Σ_i f_i γ_i F_i. To land on Σ_i
    w_i F_i, f_i γ_i must be proportional to w_i: γ_i ∝ w_i / f_i = w_i p_i. Normalised by p_max, the
    rarest worker's step is α · w_i. When every worker is always busy (concurrency C = N), it
    delivers once per compute time, p_i = τ_i: the paper's γ_i = α · w_i · τ_i / τ_max, the same
    numbers. With C < N and a uniform draw among the idle clients, f_i is set by the draw as much as
    by τ_i: p_i = W + τ_i with W the mean wait, the same for every client
    (``fl_rescaled.stepsizes.delivery_periods``), so the p_i are closer together than the τ_i and
    τ-proportional steps (``by="tau"``) over-weight the slow clients (they land on the minimiser of
    Σ (τ_i / p_i) F_i), as plain ASGD over-weights the frequent ones (Σ (1 / p_i) F_i).

    Where p_i comes from: on the virtual clock it is computed from the compute-time model when that
    is stationary and every client is always online (exact when C = N); otherwise (an availability
    model, speeds that change, the wall clock) it is estimated from each worker's deliveries, an
    exponential moving average of the time between them (``tau_smoothing``), initialised by the first.
    With τ_max the largest estimate; on the wall clock the weights are renormalised over the workers
    online (whether or not they have delivered yet, so the first replies of a run take steps of
    α · w_i, not the larger share of the few workers heard from so far).

    A worker that delivers very rarely (a client online one hour a day) would make every other
    worker's step tiny: ``max_ratio`` bounds p_max by that many times the median p, and a rarer
    worker counts as that (its aggregate weight is then below w_i, and it says so in its name:
    ``fl_rescaled.stepsizes.rescaled``).

    With ``reply="model"`` (an unchanged FedAvg ClientApp that returns its trained model) the
    same weights are applied to the pseudo-gradients Δ_i = x_sent − y_i, so fast clients still
    pull no harder than slow ones. The default α is set by how many FedAvg steps the model moves per
    round's worth of trainings (C replies, with C jobs in flight): per unit of time Rescaled's steps
    add up to α / p_max, and C replies take C · p_H / N units (the N clients deliver N / p_H replies
    per unit), so a round moves the model r = α · C · p_H / (N · p_max) times a mean Δ, and

        α = r · N · p_max / (p_H · C),   r = min(0.6 √C, √(N / C)),

    from the run's own p_i at its start, and at most 1 / max w_i (N with equal weights: no reply moves
    the model past the client's own model). 0.6 √C is FedAsync's pace: its C replies per round are
    each mixed in with weight 0.6 · (δ + 1)^(−1/2), δ about C − 1. But at C = N the clients of one
    round are the clients of the next, and steps along their shared directions add up: more than one
    FedAvg step per round overshoots when they finish together (identical speeds, 10 nodes all
    training, the example app, 5 seeds: 0.62 with 0.6 √C = 1.9, 0.58 with r = 1.25, 0.79 with r = 1,
    FedAsync 0.77; 5 nodes: 0.73 against 0.86 with r = 1, FedAsync 0.86). With C of N drawn at random
    a client comes back about every N / C rounds, and r up to √(N / C) kept pace with FedAsync (12 of
    50, speeds 1 to 16: 0.904 against FedAsync's 0.903; identical speeds: 0.894 and 0.894);
    ``docs/population.md`` has the table and the commands.

    What it converges to: with H local SGD steps at rate η on
    F_i(x) = a_i ‖x − b_i‖², Δ_i = c_i (x − b_i) with c_i = 1 − (1 − 2 η a_i)^H, and the fixed point
    is Σ w_i c_i b_i / Σ w_i c_i. With equal curvature (all c_i equal) that is the equal-weight
    point Σ w_i b_i; otherwise the c_i are the local-steps drift that FedAvg has too (clients with
    more curvature pull harder after several local steps), which vanishes as η H → 0.

    Parameters
    ----------
    weights : sequence of float, optional (default: 1/n each)
        The target mix w_i (non-negative, summing to 1), one per partition: the run then needs
        the partition query (``fl_rescaled.add_partition_query`` in the ClientApp).
    by : str (default: "rate")
        ``"rate"``: p_i, each worker's time between deliveries (see above). ``"tau"``: its compute
        time τ_i, the paper's rule as written (the same when every worker is always busy).
    max_ratio : float, optional (default: 10)
        Bounds p_max at ``max_ratio`` × the median p (None: no bound). At least 1.
    **kwargs
        The options of every strategy: as in ``AsyncStrategy`` (``reply`` defaults to ``"gradient"``).
    """

    name = "rescaled"
    uses_tau = True

    def __init__(self, *, weights: Sequence[float] | None = None, by: str = "rate", max_ratio: float | None = 10.0,
                 **kwargs: Any) -> None:
        if by not in ("rate", "tau"):
            raise ValueError(f"by must be 'rate' or 'tau', got {by!r}")
        super().__init__(rule=rescaled(max_ratio), **kwargs)
        self.weights = None if weights is None else check_weights(weights, len(weights))
        self.by, self.max_ratio = by, max_ratio

    def table(self, run: Run) -> TauTable:
        return run.periods if self.by == "rate" else run.compute_times

    @property
    def lr_per_run(self) -> bool:
        return not self.lr_given and self.reply == "model"

    def cycle_stepsize(self, run: Run) -> float:
        """``lr`` if given; else 1 (gradient replies), or for model replies r FedAvg steps per round's
        worth of trainings (above): α = r · N · p_max / (p_H · C), r = min(0.6 √C, √(N / C))."""
        if self.lr_given or self.reply == "gradient":
            return self.lr
        taus = self.table(run)
        spread = taus.tau_max / taus.tau_h if taus.tau_max > 0 and taus.tau_h > 0 else 1.0  # (1: no estimate yet)
        ceiling = 1.0 / max(self.weights) if self.weights is not None else float(run.n)
        n, c = run.n, run.concurrency
        rounds = min(FEDASYNC_MIXING * math.sqrt(c), math.sqrt(n / c))  # r: FedAvg steps per round
        return min(rounds * n * spread / c, ceiling)

    def target_weights(self) -> Sequence[float] | None:
        return self.weights

    def describe(self) -> dict:
        return {**super().describe(), "weights": self.weights, "by": self.by, "max_ratio": self.max_ratio}
