"""Stepsize rules, as small pure functions of (worker, τ estimates, delay, configuration).

Every rule is normalised by the cycle stepsize α (experiments.md): the stepsizes applied during
τ_max time units add up to α. ``taus`` are the (estimated) mean compute times of all workers.
"""

from __future__ import annotations

from collections.abc import Sequence


def equal_weights(n: int) -> tuple[float, ...]:
    return tuple(1.0 / n for _ in range(n))


def check_weights(weights: Sequence[float], n: int) -> tuple[float, ...]:
    """Validate target weights: n non-negative numbers that sum to 1."""
    w = tuple(float(x) for x in weights)
    if len(w) != n:
        raise ValueError(f"expected {n} weights, got {len(w)}")
    if any(x < 0 for x in w) or abs(sum(w) - 1.0) > 1e-6:
        raise ValueError("weights must be non-negative and sum to 1")
    return w


def rescaled_stepsize(
    worker: int, taus: Sequence[float], alpha: float, weights: Sequence[float] | None = None
) -> float:
    """Rescaled ASGD: γ_i = α · w_i · τ_i / τ_max (w_i = 1/n by default)."""
    tau_max = max(taus)
    w = weights[worker] if weights is not None else 1.0 / len(taus)
    return alpha * w * taus[worker] / tau_max


def vanilla_stepsize(taus: Sequence[float], alpha: float) -> float:
    """Vanilla ASGD: one γ = α · τ_H / (n · τ_max) for every worker (α/K for harmonic τ)."""
    n = len(taus)
    tau_h = n / sum(1.0 / t for t in taus)
    return alpha * tau_h / (n * max(taus))


DELAY_RULES = ("inverse", "authors")


def delay_adaptive_stepsize(gamma: float, delay: int, n: int, rule: str = "inverse") -> float:
    """Delay-Adaptive ASGD.

    ``inverse`` (default, the seed paper's analysis): γ / (1 + δ).
    ``authors`` (Mishchenko et al.'s code): γ · n / max(n, δ).
    """
    if delay < 0:
        raise ValueError("delay must be non-negative")
    if rule == "inverse":
        return gamma / (1.0 + delay)
    if rule == "authors":
        return gamma * n / max(n, delay)
    raise ValueError(f"unknown delay rule {rule!r}; choose one of {DELAY_RULES}")
