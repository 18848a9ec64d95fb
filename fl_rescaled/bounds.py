"""Update bounds: what a reply's update may be before a strategy sees it, composable like the stepsize rules.

A reply becomes an update, a direction g for x ← x − γ g (``fl_rescaled.manager``). A **bound** judges
that update by its L2 norm: it passes it, scales it down, or rejects it (``RejectedReply``: the reply
is then booked as ``rejected.<reason>`` and the model is untouched). A bound is a small object built
by a factory, as optax builds its transformations: its configuration is captured when it is built,
and what it learns during a run lives in a separate state, a dataclass of numbers and lists
(``init()`` makes a fresh one), which the run's checkpoints keep (``ManagerState.bounds``).

- ``clip(max_norm)``: g ← g · max_norm / ‖g‖ when ‖g‖ > max_norm;
- ``adaptive_clip(quantile)``: clip to an online estimate of a quantile of the accepted norms;
- ``outlier_guard(k)``: reject g when ‖g‖ > k × the median of the workers' latest accepted norms
  (on by default, k = ``OUTLIER_FACTOR``);
- ``chain(b1, b2, ...)``: b1, then b2 on what b1 let through, ...; the first rejection stops it.

The norm is computed in the update's own precision (one dot product; for 32 values or fewer,
``math.hypot``) and, only when that overflows, again in float64 with the vector scaled by its
largest entry, so a float32 update of 1e38s has a finite norm (1.7e38), and the guard can compare it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .errors import RejectedReply

#: The outlier guard's default factor k (see ``outlier_guard``).
OUTLIER_FACTOR = 300.0
#: How many workers' latest norms the guard keeps (the most recent distinct workers).
GUARD_WINDOW = 32


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


def lower_median(values: Sequence[float]) -> float:
    """The lower median: the ⌈m/2⌉-th smallest of m values (of two, the smaller)."""
    return sorted(values)[(len(values) - 1) // 2]


class Bound(Protocol):
    """A bound: ``init()`` makes its state; ``bound(state, update, norm, worker)`` returns the update
    it lets through and that update's norm, or raises ``RejectedReply``."""

    def init(self) -> Any: ...

    def __call__(self, state: Any, update: np.ndarray, norm: float, worker: int) -> tuple[np.ndarray, float]: ...


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
    max_norm: float

    def init(self) -> ClipState:
        return ClipState()

    def __call__(self, state: ClipState, update: np.ndarray, norm: float, worker: int) -> tuple[np.ndarray, float]:
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
    quantile: float
    rate: float
    initial: float | None

    def init(self) -> AdaptiveClipState:
        return AdaptiveClipState(clip=math.nan if self.initial is None else self.initial)

    def __call__(self, state: AdaptiveClipState, update: np.ndarray, norm: float,
                 worker: int) -> tuple[np.ndarray, float]:
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


# ------------------------------------------------------------------------------- the outlier guard
@dataclass
class GuardState:
    """Worker → its latest accepted norm, for the most recent distinct workers (oldest first)."""

    norms: dict[int, float] = field(default_factory=dict)
    rejected: int = 0

    def check(self) -> None:
        if any(not (v > 0 and math.isfinite(v)) for v in self.norms.values()):
            raise ValueError("the outlier guard's norms must be positive and finite")


@dataclass(frozen=True)
class OutlierGuard:
    factor: float
    window: int

    def init(self) -> GuardState:
        return GuardState()

    def __call__(self, state: GuardState, update: np.ndarray, norm: float, worker: int) -> tuple[np.ndarray, float]:
        if not norm > 0:  # (a zero update moves nothing and says nothing about the scale)
            return update, norm
        known = state.norms
        own = known.get(worker)
        others = len(known) - (own is not None)
        if others >= 2:  # (a median of fewer than three values cannot exclude one outlier)
            sample = list(known.values())
            if own is not None:
                sample.remove(own)  # (its own earlier norm does not vouch for it)
            sample.append(norm)
            sample.sort()
            ref = sample[(len(sample) - 1) // 2]  # the lower median
            if norm > self.factor * ref:
                state.rejected += 1
                raise RejectedReply("outlier", f"update norm {norm:.4g} is more than {self.factor:g} × {ref:.4g}, "
                                               f"the median of the latest accepted norms of {others} other workers")
        if own is not None:
            del known[worker]
        known[worker] = norm  # (the most recent; beyond the window the oldest worker is forgotten)
        if len(known) > self.window:
            del known[next(iter(known))]
        return update, norm


def outlier_guard(k: float = OUTLIER_FACTOR, *, window: int = GUARD_WINDOW) -> OutlierGuard:
    """Reject an update whose norm is more than ``k`` times the median of the workers' latest norms.

    The reference is the lower median of a sample: the latest accepted norm of each of the last
    ``window`` distinct workers other than the candidate's, plus the candidate's own norm. Per
    worker, not per reply, so a fast worker does not set the scale for everyone (its gradient may
    vanish while a slow worker's, on other data, does not); the worker's own earlier norms are left
    out, so a hostile worker whose early norms got in cannot vouch for itself. The candidate counts
    in the sample and the median is the lower one, so a single outlier is never the median of three
    or more values: the guard judges a reply once two other workers have delivered (a sample of
    three: the middle value), which in a run whose first replies come from different workers is
    from the third reply on. A rejected update is booked as ``rejected.outlier``, the model
    untouched, the worker gets a new job (and is set aside after three rejections in a row, see
    ``fl_rescaled.manager``). Zero updates pass and are not remembered (they carry no scale).

    Limits, stated plainly:

    - Until two other workers have delivered, a reply is not judged: a sample of one or two norms
      cannot tell a hostile norm from an honest one far from the other (a worker that starts at its
      own optimum has a gradient up to 90 times smaller than the next worker's in this suite's
      quadratic runs). So the first two replies of a run are never judged, nor is any reply of a
      run with fewer than three workers. If an early reply was hostile, the model it moved yields
      large honest updates, which are then outliers of the first ones: the run stops with
      ``RunFailed`` after ``max_consecutive_rejections`` (loud, not silent), unless the
      displacement was small enough to be trained away. ``clip_norm``, a bound known in advance,
      holds from the first reply.
    - It needs an honest majority: when half the recent workers are hostile, the median is theirs.
    - Updates below k × the median get in: a hostile worker can send updates up to k times the
      typical one (``clip``/``adaptive_clip`` after the guard bound those).
    - It assumes honest norms at one moment are within a factor k of one another: heterogeneous
      data and stale replies (computed on an older model while the norms shrink) spread them. A
      deterministic problem that converges geometrically to a point where every gradient vanishes
      makes that spread unbounded; turn the guard off there (``outlier_factor=None``).

    How k = 300 (``OUTLIER_FACTOR``) was chosen: the ratio of every honest norm to this reference
    was logged over the test suite's runs (332 tests, every strategy, quadratic and MNIST, virtual
    and wall clock, model and gradient replies). The largest were 55 (a population of 1000
    quadratic clients whose optima are spread out), 30 (MNIST gradients of a slow worker, stale by a
    few updates of ten workers) and 12 otherwise; k sits 5× above the largest. The hostile replies
    that ruined runs before the guard are 1000× an honest norm (a gradient scaled ×1000, a constant
    1000 against honest norms of about one) or far more (1e6, 1e30, 1e38): k sits at least 3× below.
    """
    if not 1 < k < math.inf:
        raise ValueError(f"the outlier factor must be a finite number above 1, got {k!r}")
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= 100_000:
        raise ValueError(f"the outlier guard's window must be an integer in 1..100000, got {window!r}")
    return OutlierGuard(float(k), window)


# ------------------------------------------------------------------------------- composition
#: What a bound's state may be (the schema of ``ManagerState.bounds``).
BoundState = GuardState | AdaptiveClipState | ClipState


@dataclass(frozen=True)
class Chain:
    bounds: tuple[Any, ...]

    def init(self) -> list[Any]:
        return [b.init() for b in self.bounds]

    def __call__(self, states: list[Any], update: np.ndarray, norm: float, worker: int) -> tuple[np.ndarray, float]:
        for b, s in zip(self.bounds, states):
            update, norm = b(s, update, norm, worker)
        return update, norm

    def apply(self, states: list[Any], update: np.ndarray, worker: int) -> np.ndarray:
        """The update the chain lets through (its norm computed once); raises ``RejectedReply``."""
        norm = update_norm(update)
        for b, s in zip(self.bounds, states):
            update, norm = b(s, update, norm, worker)
        return update

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


def of_options(*, clip_norm: float | None = None, adaptive_quantile: float | None = None,
               outlier_factor: float | None = OUTLIER_FACTOR) -> Chain:
    """The chain a strategy's options describe: the guard, then the adaptive clip, then the fixed clip."""
    parts: list[Any] = []
    if outlier_factor is not None:
        parts.append(outlier_guard(outlier_factor))
    if adaptive_quantile is not None:
        parts.append(adaptive_clip(adaptive_quantile))
    if clip_norm is not None:
        parts.append(clip(clip_norm))
    return chain(*parts)
