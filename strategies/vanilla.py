"""Vanilla ASGD: plain ASGD with one stepsize for everybody."""

from __future__ import annotations

from typing import Any

from fl_rescaled.stepsizes import vanilla

from .asgd import ASGD


class VanillaASGD(ASGD):
    """Plain asynchronous SGD with one step γ = α · τ_H / (n · τ_max) for every worker.

    Fast workers deliver more often, so they pull harder: the method converges to the frequency-
    weighted objective Σ (τ_i⁻¹ / Σ_j τ_j⁻¹) F_i (α/K per step under harmonic compute times).

    Parameters
    ----------
    **kwargs
        The options of every strategy: as in ``AsyncStrategy``.
    """

    name = "vanilla"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(rule=vanilla(), **kwargs)
