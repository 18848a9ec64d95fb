"""Update bounds: what a reply's update may be before a strategy sees it, composable like the stepsize rules.

A reply becomes an update, a direction g for x ← x − γ g (``fl_rescaled.manager``). A **bound** judges
that update by its L2 norm: it passes it, scales it down, or rejects it (``RejectedReply``: the reply
is then booked as ``rejected.<reason>`` and the model is untouched). A bound is a small object built
by a factory, as optax builds its transformations: its configuration is captured when it is built,
and what it learns during a run lives in a separate state, a dataclass of numbers and lists
(``init()`` makes a fresh one), which the run's checkpoints keep (``ManagerState.bounds``). A bound
is called as ``bound(state, update, norm, worker, share)`` and returns the update it lets through
and its norm; ``share`` is how much the strategy weighs ``worker``'s replies per unit of time (only
the median clip reads it).

- ``clip(max_norm)``: g ← g · max_norm / ‖g‖ when ‖g‖ > max_norm;
- ``adaptive_clip(quantile)``: clip to an online estimate of a quantile of the accepted norms;
- ``outlier_guard(k)``: reject g when ‖g‖ > k × the median of the workers' latest accepted norms
  (on by default, k = ``OUTLIER_FACTOR``);
- ``median_clip(c)``: scale g down to c × the upper median of the other workers' latest norms, each
  weighted by how far its worker moves the model per unit of time (on by default, c =
  ``CLIP_FACTOR``); these two judge an update against the other workers' (``fl_rescaled.peer_bounds``);
- ``chain(b1, b2, ...)``: b1, then b2 on what b1 let through, ...; the first rejection stops it.

The norm is computed in the update's own precision (one dot product; for 32 values or fewer,
``math.hypot``) and, only when that overflows, again in float64 with the vector scaled by its
largest entry, so a float32 update of 1e38s has a finite norm (1.7e38), and the guard can compare it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .peer_bounds import (CLIP_FACTOR, GUARD_WINDOW, OUTLIER_FACTOR, GuardState, MedianClip, MedianClipState,
                          OutlierGuard, median_clip, outlier_guard, reference, remember)

__all__ = ["CLIP_FACTOR", "GUARD_WINDOW", "OUTLIER_FACTOR", "AdaptiveClip", "AdaptiveClipState", "BoundOptions", "BoundState",
           "Chain", "Clip", "ClipState", "GuardState", "MedianClip", "MedianClipState", "OutlierGuard", "adaptive_clip",
           "adaptive_clip_next", "chain", "clip", "finite_norm", "lower_median", "median_clip", "of_options", "outlier_guard",
           "reference", "remember", "update_norm"]


def update_norm(update: np.ndarray) -> float:
    """‖update‖₂ (float64), finite for any finite update of any float type."""
    if update.size <= 32:  # (small: Python's hypot, exact and safe from overflow, and cheaper than numpy here)
        return math.hypot(*update.tolist())
    with np.errstate(over="ignore"):
        sq = float(np.dot(update, update))
    if math.isfinite(sq):
        return math.sqrt(sq)
    top = float(np.max(np.abs(update)))  # (the squares overflowed the update's type)
    if not (top > 0 and math.isfinite(top)):
        return top
    scaled = update.astype(np.float64) / top
    return top * math.sqrt(float(np.dot(scaled, scaled)))


def finite_norm(update: np.ndarray) -> float | None:
    """``update_norm(update)`` when every value of the 1-d ``update`` is finite, else None: the
    validation's finiteness test and the bounds' norm in one pass over a finite update (the same dot
    product both take: a sum of squares is finite only if every term is)."""
    if update.size > 32:
        with np.errstate(over="ignore", invalid="ignore"):
            sq = float(np.dot(update, update))
        if math.isfinite(sq):
            return math.sqrt(sq)
    return update_norm(update) if np.isfinite(update).all() else None


def lower_median(values: Sequence[float]) -> float:
    """The lower median: the ⌈m/2⌉-th smallest of m values (of two, the smaller)."""
    return sorted(values)[(len(values) - 1) // 2]


def _scaled(update: np.ndarray, norm: float, target: float) -> tuple[np.ndarray, float]:
    """``update`` scaled to norm ``target`` (a new array, in the update's type)."""
    return update * (target / norm), target


# ------------------------------------------------------------------------------- clip
@dataclass
class ClipState:
    """How many updates a fixed clip has scaled down."""

    clipped: int = 0


@dataclass(frozen=True)
class Clip:
    """Scale an update whose L2 norm exceeds ``max_norm`` down to it (``clip``)."""

    max_norm: float

    def init(self) -> ClipState:
        return ClipState()

    def __call__(self, state: ClipState, update: np.ndarray, norm: float, worker: int,
                 share: float = 1.0) -> tuple[np.ndarray, float]:
        if norm <= self.max_norm:
            return update, norm
        state.clipped += 1
        return _scaled(update, norm, self.max_norm)


def clip(max_norm: float) -> Clip:
    """Scale an update whose L2 norm exceeds ``max_norm`` down to ``max_norm``: g · max_norm / ‖g‖."""
    if isinstance(max_norm, bool) or not (isinstance(max_norm, (int, float)) and 0 < max_norm < math.inf):
        raise ValueError(f"the clip norm must be positive and finite, got {max_norm!r}")
    return Clip(float(max_norm))


# ------------------------------------------------------------------------------- adaptive clip
@dataclass
class AdaptiveClipState:
    """The current clip norm C (NaN until the first update) and how many updates it scaled down."""

    clip: float = math.nan
    clipped: int = 0
    seen: int = 0


@dataclass(frozen=True)
class AdaptiveClip:
    """Clip every update to an online estimate of the ``quantile`` of the accepted norms (``adaptive_clip``)."""

    quantile: float
    rate: float
    initial: float | None

    def init(self) -> AdaptiveClipState:
        return AdaptiveClipState(clip=math.nan if self.initial is None else self.initial)

    def __call__(self, state: AdaptiveClipState, update: np.ndarray, norm: float, worker: int,
                 share: float = 1.0) -> tuple[np.ndarray, float]:
        c = state.clip
        if math.isnan(c):
            c = norm  # (no initial norm given: the first update's, which it then passes)
        below = norm <= c
        state.clip = adaptive_clip_next(c, below, self.quantile, self.rate)
        state.seen += 1
        if below:
            return update, norm
        state.clipped += 1
        return _scaled(update, norm, c)


def adaptive_clip_next(c: float, below: bool, quantile: float, rate: float) -> float:
    """The next clip norm: C · exp(−η (b − q)), with b = 1 when the update's norm was ≤ C, else 0."""
    return c * math.exp(-rate * ((1.0 if below else 0.0) - quantile))


def adaptive_clip(quantile: float = 0.5, *, rate: float = 0.2, initial: float | None = None) -> AdaptiveClip:
    """Clip every update to C, an online estimate of the ``quantile`` of the accepted norms.

    After each update C ← C · exp(−η (b − q)), b = 1 if the update's norm was at most C, else 0: C
    grows while fewer than a fraction q of the norms fall below it and shrinks while more do, so it
    settles where P(‖g‖ ≤ C) = q. This is the geometric update of Andrew et al., "Differentially
    Private Learning with Adaptive Clipping" (NeurIPS 2021), applied per update instead of per round;
    their defaults are q = 0.5 and η = 0.2 (per update, C then moves by at most a factor e^(±η·max(q, 1−q))).

    ``initial``: C before the first update (default: the first update's norm). C can only follow
    the norms at that pace: from a first norm 10^k times the typical one it takes about
    k · ln 10 / (η q) updates to come down, which is why the outlier guard runs before it.
    """
    if not 0 < quantile < 1:
        raise ValueError(f"the adaptive clip's quantile must be in (0, 1), got {quantile!r}")
    if not 0 < rate <= 10:
        raise ValueError(f"the adaptive clip's rate must be in (0, 10], got {rate!r}")
    if initial is not None and not 0 < initial < math.inf:
        raise ValueError(f"the adaptive clip's initial norm must be positive and finite, got {initial!r}")
    return AdaptiveClip(float(quantile), float(rate), None if initial is None else float(initial))


# ------------------------------------------------------------------------------- composition
#: What a bound's state may be (the schema of ``ManagerState.bounds``).
BoundState = GuardState | MedianClipState | AdaptiveClipState | ClipState


@dataclass(frozen=True)
class Chain:
    """Bounds applied in order to each update (``chain``); each keeps its own state in ``init()``'s list."""

    bounds: tuple[Any, ...]

    def init(self) -> list[Any]:
        return [b.init() for b in self.bounds]

    def __call__(self, states: list[Any], update: np.ndarray, norm: float, worker: int,
                 share: float = 1.0) -> tuple[np.ndarray, float]:
        for b, s in zip(self.bounds, states):
            update, norm = b(s, update, norm, worker, share)
        return update, norm

    def apply(self, states: list[Any], update: np.ndarray, worker: int, share: float = 1.0,
              norm: float | None = None) -> np.ndarray:
        """The update the chain lets through (its norm ``norm``, computed here when None, once);
        raises ``RejectedReply``."""
        return self(states, update, update_norm(update) if norm is None else norm, worker, share)[0]

    def _state_of(self, states: list[Any], kind: type) -> Any:
        """The state of this chain's first bound of ``kind`` (None without one)."""
        return next((s for b, s in zip(self.bounds, states) if isinstance(b, kind)), None)

    def suspicion(self, states: list[Any], worker: int) -> tuple[int, float]:
        """``worker``'s updates judged by the median clip and the geometric mean of their ratios to
        the reference (``MedianClip.suspicion``; (0, 1) without a median clip)."""
        clipped = self._state_of(states, MedianClip)
        return (0, 1.0) if clipped is None else MedianClip.suspicion(clipped, worker)

    def largest(self, states: list[Any], k: int) -> list[tuple[int, float]]:
        """The ``k`` workers whose updates stood furthest above the others': by the median clip's
        moving ratios (``MedianClip.largest``), else by the outlier guard's latest norms over their
        median; none without either."""
        clipped = self._state_of(states, MedianClip)
        if clipped is not None:
            return MedianClip.largest(clipped, k)
        guarded = self._state_of(states, OutlierGuard)
        if guarded is None or not guarded.norms:
            return []
        median = lower_median(list(guarded.norms.values()))
        return [(int(w), v / median) for w, v in sorted(guarded.norms.items(), key=lambda kv: -kv[1])[:k]]

    def check(self, states: list[Any]) -> None:
        """Raise ValueError when ``states`` (read from a checkpoint) are not this chain's."""
        kinds = [type(b.init()) for b in self.bounds]
        if [type(s) for s in states] != kinds:
            raise ValueError(f"the checkpoint's update bounds ({', '.join(type(s).__name__ for s in states)}) "
                             f"are not this run's ({', '.join(k.__name__ for k in kinds)})")


def chain(*bounds: Any) -> Chain:
    """The bounds in order: each one judges what the previous let through; the first rejection stops it."""
    flat: list[Any] = []
    for b in bounds:
        flat.extend(b.bounds if isinstance(b, Chain) else [b])
    return Chain(tuple(flat))


@dataclass
class BoundOptions:
    """The update bounds' options (``AsyncStrategy``'s ``outlier_factor``, ``clip_factor``,
    ``adaptive_clip``, ``clip_norm``; documented there): the chain every update passes (``chain``)."""

    outlier_factor: float | None = OUTLIER_FACTOR
    clip_factor: float | None = CLIP_FACTOR
    adaptive_clip: float | None = None
    clip_norm: float | None = None

    def chain(self) -> Chain:
        """The chain these options describe (ValueError for a bad one)."""
        return of_options(clip_norm=self.clip_norm, adaptive_quantile=self.adaptive_clip,
                          outlier_factor=self.outlier_factor, clip_factor=self.clip_factor)


def of_options(*, clip_norm: float | None = None, adaptive_quantile: float | None = None,
               outlier_factor: float | None = OUTLIER_FACTOR, clip_factor: float | None = CLIP_FACTOR) -> Chain:
    """The chain a strategy's options describe: the guard, the median clip, the adaptive clip, the fixed clip."""
    parts: list[Any] = []
    if outlier_factor is not None:
        parts.append(outlier_guard(outlier_factor))
    if clip_factor is not None:
        parts.append(median_clip(clip_factor))
    if adaptive_quantile is not None:
        parts.append(adaptive_clip(adaptive_quantile))
    if clip_norm is not None:
        parts.append(clip(clip_norm))
    return chain(*parts)
