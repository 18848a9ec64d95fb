"""Stepsize and staleness rules: small pure functions, and the factories that compose them.

Every ASGD stepsize is normalised by the cycle stepsize α (experiments.md): the stepsizes applied
during τ_max time units add up to α. A **rule** is a pure function ``rule(alpha, worker, taus, delay)
-> γ`` of the worker, the τ estimates (a ``TauTable``), the reply's delay δ = k − v and the rule's
own configuration (captured by its factory, as in optax). A **staleness** function maps a step and
the delay to a discounted step, ``staleness(gamma, delay, n) -> γ'``; ``scaled_by(rule, staleness)``
composes the two. ``RULES`` and ``STALENESS`` name the factories the strategies are built from.

The formulas are written once, as scalar functions (``rescaled_step``, ``vanilla_step``, ...), and
evaluated in the same order whatever calls them, so a run's trajectory does not depend on which
path computed its steps.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

Rule = Callable[[float, int, "TauTable", int], float]
Staleness = Callable[[float, int, int], float]


# ------------------------------------------------------------------------------- the formulas
def rescaled_step(alpha: float, share: float, tau_i: float, tau_max: float) -> float:
    """Rescaled ASGD: γ_i = α · w_i · τ_i / τ_max."""
    return alpha * share * tau_i / tau_max


def vanilla_step(alpha: float, tau_h: float, n: int, tau_max: float) -> float:
    """Vanilla ASGD: γ = α · τ_H / (n · τ_max) for every worker (α/K for harmonic τ)."""
    return alpha * tau_h / (n * tau_max)


def harmonic_mean(taus: Sequence[float]) -> float:
    return len(taus) / sum(1.0 / t for t in taus)


def check_weights(weights: Sequence[float], n: int) -> tuple[float, ...]:
    """Validate target weights: n non-negative numbers that sum to 1."""
    w = tuple(float(x) for x in weights)
    if len(w) != n:
        raise ValueError(f"expected {n} weights, got {len(w)}")
    if any(x < 0 for x in w) or abs(sum(w) - 1.0) > 1e-6:
        raise ValueError("weights must be non-negative and sum to 1")
    return w


def rescaled_stepsize(worker: int, taus: Sequence[float], alpha: float,
                      weights: Sequence[float] | None = None) -> float:
    """Rescaled ASGD's γ_i over a list of mean compute times (w_i = 1/n by default)."""
    w = weights[worker] if weights is not None else 1.0 / len(taus)
    return rescaled_step(alpha, w, taus[worker], max(taus))


def vanilla_stepsize(taus: Sequence[float], alpha: float) -> float:
    """Vanilla ASGD's γ over a list of mean compute times."""
    return vanilla_step(alpha, harmonic_mean(taus), len(taus), max(taus))


# ------------------------------------------------------------------------------- staleness
def constant() -> Staleness:
    """No discount: s(δ) = 1."""
    return _constant


def polynomial(a: float = 0.5) -> Staleness:
    """γ · (δ + 1)^(−a) (FedAsync's polynomial s, FedBuff's 1/(1 + δ)^p)."""
    if not a >= 0:
        raise ValueError(f"the staleness exponent must be non-negative, got {a!r}")
    return partial(_polynomial, a)


def hinge(a: float = 0.5, b: int = 4) -> Staleness:
    """γ if δ ≤ b, else γ / (a (δ − b) + 1) (FedAsync's hinge s)."""
    if not a > 0 or b < 0:
        raise ValueError("hinge staleness needs a > 0 and b >= 0")
    return partial(_hinge, a, b)


def inverse() -> Staleness:
    """γ / (1 + δ) (Delay-Adaptive ASGD as the seed paper analyses it)."""
    return _inverse


def authors() -> Staleness:
    """γ · n / max(n, δ) (Mishchenko et al.'s code: no discount up to n updates of delay)."""
    return _authors


# The discounts themselves: module-level functions (and partials of them), so that a strategy that
# holds one can be written to a checkpoint and read back.
def _constant(gamma: float, delay: int, n: int) -> float:
    return gamma


def _polynomial(a: float, gamma: float, delay: int, n: int) -> float:
    return gamma * float((delay + 1) ** (-a))


def _hinge(a: float, b: int, gamma: float, delay: int, n: int) -> float:
    return gamma * (1.0 if delay <= b else 1.0 / (a * (delay - b) + 1.0))


def _inverse(gamma: float, delay: int, n: int) -> float:
    return gamma / (1.0 + delay)


def _authors(gamma: float, delay: int, n: int) -> float:
    return gamma * n / max(n, delay)


#: Staleness factories by name (the options of FedAsync and Delay-Adaptive ASGD).
STALENESS: dict[str, Callable[..., Staleness]] = {
    "constant": constant, "polynomial": polynomial, "hinge": hinge, "inverse": inverse, "authors": authors,
}


def fedasync_staleness(kind: str = "polynomial", a: float = 0.5, b: int = 4) -> Staleness:
    """FedAsync's staleness function s by name: ``constant``, ``polynomial`` (exponent a) or
    ``hinge`` (slope a, threshold b)."""
    if kind == "constant":
        return constant()
    if kind == "polynomial":
        return polynomial(a)
    if kind == "hinge":
        return hinge(a, b)
    raise ValueError(f"unknown staleness function {kind!r}; choose constant, polynomial or hinge")


def delay_adaptive_stepsize(gamma: float, delay: int, n: int, rule: str = "inverse") -> float:
    """Delay-Adaptive ASGD's step from the base γ: ``inverse`` γ / (1 + δ), ``authors`` γ · n / max(n, δ)."""
    if delay < 0:
        raise ValueError("delay must be non-negative")
    if rule not in DELAY_RULES:
        raise ValueError(f"unknown delay rule {rule!r}; choose one of {DELAY_RULES}")
    return STALENESS[rule]()(gamma, delay, n)


DELAY_RULES = ("inverse", "authors")


# ------------------------------------------------------------------------------- τ estimates
class TauTable:
    """The mean compute time τ_i of every worker and the statistics the rules read.

    Fixed (the virtual clock: τ_i known, every worker active): τ_max, τ_H and the median are
    computed once. Online (the wall clock, or a population's delivery periods): estimates arrive one
    worker at a time and workers leave and return; Σ 1/τ_i and the active weight are kept up to date
    in O(1) per change and recomputed exactly every n changes so rounding cannot drift; τ_max is
    kept too, and recomputed over the workers (O(n)) only when the worker that holds it goes down
    or leaves; the median every n changes. Memory is a few arrays of n, whatever the number of
    changes (a week-long run). ``estimated=True`` with ``taus``: online estimates that start from
    ``taus`` (kept as ``prior``).
    """

    def __init__(self, n: int, taus: Sequence[float] | None = None, weights: Sequence[float] | None = None,
                 *, estimated: bool = False) -> None:
        self.n = int(n)
        self.fixed = taus is not None and not estimated
        # (compact per-worker storage: 8 bytes a worker, 1 for the flag; a population can be large)
        self.taus = array("d", taus) if taus is not None else array("d", [math.nan]) * self.n
        if len(self.taus) != self.n:
            raise ValueError(f"{len(self.taus)} compute times for {self.n} workers")
        self.prior = array("d", self.taus)
        self.active = bytearray(b"\x01") * self.n
        self.n_active = self.n
        known = taus is not None
        self.n_known = self.n if known else 0
        self.tau_max = max(self.taus) if known and self.n else math.nan
        self.tau_h = harmonic_mean(self.taus) if known and self.n else math.nan
        self._inv_sum = sum(1.0 / t for t in self.taus) if known else 0.0
        # (online tables) each active worker's estimate, -inf where none: where τ_max is looked for
        self._live = None if self.fixed else np.array(self.taus if known else [-math.inf] * self.n, np.float64)
        self._argmax = int(np.argmax(self._live)) if self._live is not None and known and self.n else -1
        self._changes = 0
        self._median = float(np.median(self.taus)) if known and self.n else math.nan
        self.set_weights(weights)

    def set_weights(self, weights: Sequence[float] | None) -> None:
        """Target weights w_i (Rescaled ASGD's mix; None: equal)."""
        self.weights = None if weights is None else check_weights(weights, self.n)
        if self.weights is not None:
            self._weight_active = sum(w for w, a in zip(self.weights, self.active) if a)

    def share(self, worker: int) -> float:
        """Worker i's target weight among the active workers (1/n_active by default)."""
        if self.weights is None:
            return 1.0 / self.n_active
        if self.n_active == self.n:
            return self.weights[worker]
        return self.weights[worker] / self._weight_active

    def update(self, worker: int, tau: float) -> None:
        """A new estimate of worker ``worker``'s τ (an online table)."""
        if self.fixed:
            raise RuntimeError("the compute times of a virtual clock are fixed")
        if not (tau > 0 and math.isfinite(tau)):
            raise ValueError(f"a compute time must be positive and finite, got {tau!r}")
        old = self.taus[worker]
        self.taus[worker] = tau = float(tau)
        if self.active[worker]:
            if math.isnan(old):
                self.n_known += 1
            else:
                self._inv_sum -= 1.0 / old
            self._inv_sum += 1.0 / tau
            self._set_live(worker, tau)
            self._refresh()

    def set_active(self, worker: int, active: bool) -> None:
        """A worker left (its node is gone) or came back: it counts in the statistics only while active."""
        if bool(self.active[worker]) == bool(active):
            return
        self.active[worker] = bool(active)
        self.n_active += 1 if active else -1
        if self.weights is not None:
            self._weight_active += self.weights[worker] if active else -self.weights[worker]
        tau = self.taus[worker]
        if not math.isnan(tau):
            self.n_known += 1 if active else -1
            self._inv_sum += 1.0 / tau if active else -1.0 / tau
            if self._live is not None:
                self._set_live(worker, tau if active else -math.inf)
        self._refresh()

    def _set_live(self, worker: int, value: float) -> None:
        live = self._live
        assert live is not None
        live[worker] = value
        if value >= self.tau_max or not self.tau_max == self.tau_max:
            self.tau_max, self._argmax = value, worker
        elif worker == self._argmax:  # the largest went down or left: look again
            self._argmax = int(np.argmax(live))
            self.tau_max = float(live[self._argmax])
        if self.tau_max == -math.inf:
            self.tau_max, self._argmax = math.nan, -1

    def _refresh(self) -> None:
        self._changes += 1
        if self._changes >= self.n:  # exact sums now and then: incremental ones accumulate rounding
            self._changes = 0
            known = [t for t, a in zip(self.taus, self.active) if a and not math.isnan(t)]
            self._inv_sum = sum(1.0 / t for t in known)
            if self.weights is not None:
                self._weight_active = sum(w for w, a in zip(self.weights, self.active) if a)
        self.tau_h = self.n_known / self._inv_sum if self.n_known else math.nan
        if self._changes == 0 or math.isnan(self._median):  # (the median: every n changes, or when unknown)
            live = self._live[np.isfinite(self._live)] if self._live is not None else np.zeros(0)
            self._median = float(np.median(live)) if live.size else math.nan

    def period(self, worker: int) -> float:
        """τ_i, or the median τ while worker ``worker`` has no estimate (1 while no worker has one)."""
        tau = self.taus[worker]
        if 0 < tau < math.inf:
            return tau
        return self._median if 0 < self._median < math.inf else 1.0

    def expected_delay(self, worker: int) -> float:
        """About how many other workers' deliveries arrive during one of ``worker``'s: τ_i · Σ_j 1/τ_j − 1
        over the workers with an estimate (0 without any)."""
        return max(0.0, self.period(worker) * self._inv_sum - 1.0)

    def reference(self, max_ratio: float | None) -> float:
        """τ_max, or at most ``max_ratio`` × the median τ (None: no bound)."""
        if max_ratio is None or not self._median == self._median:  # (no bound, or no median yet)
            return self.tau_max
        return min(self.tau_max, max_ratio * self._median)


def delivery_periods(taus: Sequence[float], concurrency: int) -> np.ndarray:
    """Each client's mean time between deliveries, p_i = 1 / f_i, when at most ``concurrency`` (C) of
    the n clients train at a time and a freed slot goes to a client drawn uniformly from the idle ones.

    Derivation. A client alternates idle waits and jobs of mean length τ_i. There are always n − C
    idle clients and a slot is refilled uniformly among them (the one that just finished included),
    so the mean wait W is the same for every client, whatever its τ: p_i = W + τ_i (renewal-reward).
    Every slot is busy all the time, so Σ_i τ_i / p_i = C (Little's law: the busy clients, counted
    by their share of time busy). The left side falls from n (W = 0) to 0, so W is the one root;
    it is found by bisection. With C = n, W = 0 and p_i = τ_i: the paper's setting, where every
    worker is always busy. (W is exact in the mean-field limit of many clients; for a handful the
    small correlation between a client's waits and the others' speeds is ignored.)
    """
    t = np.asarray(taus, dtype=np.float64)
    n, c = t.size, int(concurrency)
    if not 1 <= c:
        raise ValueError(f"concurrency must be at least 1, got {concurrency!r}")
    if c >= n:
        return t.copy()
    lo, hi = 0.0, float(t.sum()) / c  # Σ τ_i / (W + τ_i) ≤ Σ τ_i / W = C at W = hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if float(np.sum(t / (mid + t))) > c:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * max(1.0, hi):
            break
    return t + 0.5 * (lo + hi)


# ------------------------------------------------------------------------------- rule factories
def rescaled(max_ratio: float | None = None) -> Rule:
    """Rescaled ASGD: γ_i = α · w_i · τ_i / τ_max, with the table's target weights w_i (renormalised
    over the active workers; equal by default). Worker i's steps then add up to α · w_i per τ_max
    whatever its speed. (A reply of a worker that has just left still counts with its own τ.)

    ``max_ratio`` bounds the steps when one worker's τ (its time between deliveries) is far above the
    others': τ_max is replaced by min(τ_max, max_ratio × median τ), and a τ_i above that counts as
    that. The rarest workers' aggregate weight is then below w_i (they deliver too rarely to be
    given their full share), in exchange for the others' steps not shrinking with the rarest one.
    """
    if max_ratio is None:
        return _rescaled
    if not (max_ratio >= 1 and math.isfinite(max_ratio)):
        raise ValueError(f"max_ratio must be at least 1, got {max_ratio!r}")
    return partial(_rescaled_bounded, float(max_ratio))


def vanilla() -> Rule:
    """Vanilla ASGD: one step γ = α · τ_H / (n · τ_max) for every worker (over the known τ)."""
    return _vanilla


def scaled_by(base: Rule, staleness: Staleness) -> Rule:
    """``base``'s step discounted by the reply's delay: staleness(γ_base, δ, n)."""
    return partial(_scaled, base, staleness)


def _rescaled(alpha: float, worker: int, taus: TauTable, delay: int) -> float:
    tau_i, tau_max = taus.taus[worker], taus.tau_max
    if not tau_max >= tau_i:
        tau_max = tau_i
    return rescaled_step(alpha, taus.share(worker), tau_i, tau_max)


def _rescaled_bounded(max_ratio: float, alpha: float, worker: int, taus: TauTable, delay: int) -> float:
    tau_ref = taus.reference(max_ratio)
    tau_i = taus.taus[worker]
    if not tau_ref >= tau_i:
        tau_i = tau_ref if tau_ref == tau_ref else tau_i
        tau_ref = tau_i
    return rescaled_step(alpha, taus.share(worker), tau_i, tau_ref)


def _vanilla(alpha: float, worker: int, taus: TauTable, delay: int) -> float:
    return vanilla_step(alpha, taus.tau_h, taus.n_known, taus.tau_max)


def _scaled(base: Rule, staleness: Staleness, alpha: float, worker: int, taus: TauTable, delay: int) -> float:
    return staleness(base(alpha, worker, taus, delay), delay, taus.n)


def delay_adaptive(rule: str = "inverse") -> Rule:
    """Delay-Adaptive ASGD: Vanilla's step discounted by the delay, ``"inverse"`` γ / (1 + δ) (the
    seed paper's analysis) or ``"authors"`` γ · n / max(n, δ) (Mishchenko et al.'s code)."""
    if rule not in DELAY_RULES:
        raise ValueError(f"unknown delay rule {rule!r}; choose one of {DELAY_RULES}")
    return scaled_by(vanilla(), STALENESS[rule]())


def damped_rescaled(exponent: float = 0.5) -> Rule:
    """Rescaled ASGD with its steps discounted by staleness: γ_i · (1 + δ)^(−p).

    A stale reply moves the model less. Slow workers' replies are the stale ones, so the discount
    tilts the mix back toward the fast workers (p = 0 is Rescaled ASGD; larger p, more tilt).

    Parameters
    ----------
    exponent : float (default: 0.5)
        p, the staleness exponent (non-negative).
    """
    return scaled_by(rescaled(), polynomial(exponent))


#: Stepsize rules by name: what ``ASGD(rule=...)`` accepts and the registry builds strategies from.
RULES: dict[str, Callable[..., Rule]] = {"rescaled": rescaled, "vanilla": vanilla, "delay-adaptive": delay_adaptive}
