"""Bounds that judge an update against the other workers': the outlier guard and the median clip.

Both compare an update with the latest value of each of the last ``GUARD_WINDOW`` distinct other
workers, plus the candidate's own. Per worker, not per reply, so a fast worker does not set the
scale for everyone; the worker's own earlier values are left out, so a hostile worker whose early
updates got in cannot vouch for itself; the candidate counts in the sample, so a single outlier is
never the median of three or more values. Until two other workers have delivered nothing is judged.

- ``outlier_guard(k)`` rejects an update whose norm is more than k (300) times the *lower* median
  of the others' latest accepted norms: a reply of absurd size (1e38, a gradient ×1000) never
  touches the model;
- ``median_clip(c)`` scales an update down when its *weighted* norm is more than c (1.5) times the
  *upper* median of the others' latest weighted norms: no client moves the model, per unit of time,
  more than c times as far as the median client does. The weight is the strategy's
  ``influence(run, worker)``: 1 where every client's steps add up to its share whatever its speed
  (Rescaled ASGD, the round-based methods), the step at the client's typical staleness over its
  delivery period where each reply counts alike (Vanilla and Delay-Adaptive ASGD, FedAsync,
  FedBuff), so that a fast client's frequency counts as much as its norm.

Why the upper median for the clip: with the lower one, clients at their optimum (norms near 0)
would be the reference of clients far from theirs, and a population split in two would be clipped
toward one half; the upper median has the same breakdown point (a minority of outliers cannot be
it) without that. Why c = 1.5 and the weight: ``docs/reliability.md`` (measured against lying
clients at every speed, and a quarter of sybils, and on the honest runs). Both bounds are in
``fl_rescaled.bounds``'s default chain (``of_options``); ``bounds`` re-exports them. The median
clip's state also keeps each worker's moving ratio to its reference, which the client manager reads
to set aside a client far above the others (``fl_rescaled.manager.reputation``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .errors import RejectedReply

#: The outlier guard's default factor k (see ``outlier_guard``).
OUTLIER_FACTOR = 300.0
#: The median clip's default factor c (see ``median_clip``).
CLIP_FACTOR = 1.5
#: How many workers' latest norms the guard and the clip keep (the most recent distinct workers).
GUARD_WINDOW = 32
#: The weight of a new update in a worker's moving average of log(weighted norm / reference).
SUSPICION_RATE = 0.1


def reference(latest: dict[int, float], worker: int, value: float, upper: bool = False) -> tuple[float, int]:
    """(The lower median of the other workers' latest values and ``value``, how many others): the scale
    a relative bound judges ``worker``'s ``value`` by. With fewer than two others the reference is
    ``inf`` (nothing is judged): a median of fewer than three values cannot exclude one outlier."""
    own = latest.get(worker)
    others = len(latest) - (own is not None)
    if others < 2:
        return math.inf, others
    sample = list(latest.values())
    if own is not None:
        sample.remove(own)  # (its own earlier value does not vouch for it)
    sample.append(value)
    sample.sort()
    return sample[len(sample) // 2 if upper else (len(sample) - 1) // 2], others


def remember(latest: dict[int, float], worker: int, value: float, window: int) -> None:
    """``worker``'s latest value becomes the most recent; beyond ``window`` workers the oldest is forgotten."""
    latest.pop(worker, None)
    latest[worker] = value
    if len(latest) > window:
        del latest[next(iter(latest))]


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
    """Reject an update far above the median of the workers' latest norms (``outlier_guard``)."""

    factor: float
    window: int

    def init(self) -> GuardState:
        return GuardState()

    def __call__(self, state: GuardState, update: np.ndarray, norm: float, worker: int,
                 share: float = 1.0) -> tuple[np.ndarray, float]:
        if not norm > 0:  # (a zero update moves nothing and says nothing about the scale)
            return update, norm
        ref, others = reference(state.norms, worker, norm)
        if norm > self.factor * ref:
            state.rejected += 1
            raise RejectedReply("outlier", f"update norm {norm:.4g} is more than {self.factor:g} × {ref:.4g}, "
                                           f"the median of the latest accepted norms of {others} other workers")
        remember(state.norms, worker, norm, self.window)
        return update, norm


# ------------------------------------------------------------------------------- the median clip
@dataclass(eq=False)
class MedianClipState:
    """Worker → its latest weighted norm, and its latest norm as such, for the most recent distinct
    workers (oldest first); how many updates were clipped; per worker (index), how many of its
    updates were judged and two moving averages over them: of log(weighted norm / reference) and of
    log(norm / the same reference of plain norms) (``MedianClip.suspicion``)."""

    latest: dict[int, float] = field(default_factory=dict)
    plain: dict[int, float] = field(default_factory=dict)
    clipped: int = 0
    judged: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    log_ratio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    log_plain: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))

    def check(self) -> None:
        norms = [*self.latest.values(), *self.plain.values()]
        if any(not (v > 0 and math.isfinite(v)) for v in norms) or self.clipped < 0:
            raise ValueError("the median clip's norms must be positive and finite")
        arrays = (self.judged, self.log_ratio, self.log_plain)
        if any(a.shape != self.judged.shape for a in arrays) or self.judged.ndim != 1 or (self.judged < 0).any() \
                or not (np.isfinite(self.log_ratio).all() and np.isfinite(self.log_plain).all()):
            raise ValueError("the median clip's per-worker counts and ratios must be one finite value per worker")

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, MedianClipState) and self.latest == other.latest and self.plain == other.plain
                and self.clipped == other.clipped and np.array_equal(self.judged, other.judged)
                and np.array_equal(self.log_ratio, other.log_ratio) and np.array_equal(self.log_plain, other.log_plain))

    def grow(self, worker: int) -> None:
        if worker >= self.judged.size:
            more = max(worker + 1, 2 * self.judged.size) - self.judged.size
            self.judged = np.concatenate([self.judged, np.zeros(more, np.int64)])
            self.log_ratio = np.concatenate([self.log_ratio, np.zeros(more)])
            self.log_plain = np.concatenate([self.log_plain, np.zeros(more)])


@dataclass(frozen=True)
class MedianClip:
    """Scale an update down to ``factor`` × the median of the other workers' latest weighted norms
    (``median_clip``)."""

    factor: float
    window: int

    def init(self) -> MedianClipState:
        return MedianClipState()

    def __call__(self, state: MedianClipState, update: np.ndarray, norm: float, worker: int,
                 share: float = 1.0) -> tuple[np.ndarray, float]:
        if not norm > 0:
            return update, norm
        if not (share > 0 and math.isfinite(share)):
            share = 1.0
        weighted = norm * share
        ref, _ = reference(state.latest, worker, weighted, upper=True)
        if ref < math.inf:
            plain_ref, _ = reference(state.plain, worker, norm, upper=True)
            state.grow(worker)
            state.judged[worker] += 1
            state.log_ratio[worker] += SUSPICION_RATE * (math.log(weighted / ref) - state.log_ratio[worker])
            state.log_plain[worker] += SUSPICION_RATE * (math.log(norm / plain_ref) - state.log_plain[worker])
        remember(state.latest, worker, weighted, self.window)  # (what it sent: see ``median_clip``)
        remember(state.plain, worker, norm, self.window)
        limit = self.factor * ref
        if weighted > limit:
            state.clipped += 1
            target = limit / share
            update, norm = update * (target / norm), target
        return update, norm

    @staticmethod
    def suspicion(state: MedianClipState, worker: int) -> tuple[int, float]:
        """(How many of ``worker``'s updates were judged, how far above the others' they stood: the
        smaller of two geometric means, as moving averages over about the last ``1 / SUSPICION_RATE``,
        of their ratios to the reference, weighted and plain). Both must be high: an honest fast
        client of FedAsync weighs much (its plain norms are the others'), an honest slow client of
        Vanilla ASGD on one-class data sends large gradients (it weighs little); a client that lies
        about its update's size does both."""
        if worker >= state.judged.size:
            return 0, 1.0
        return int(state.judged[worker]), math.exp(float(min(state.log_ratio[worker], state.log_plain[worker])))

    @staticmethod
    def largest(state: MedianClipState, k: int) -> list[tuple[int, float]]:
        """(worker, moving geometric-mean ratio) of the ``k`` judged workers with the largest, largest first."""
        judged = np.flatnonzero(state.judged > 0)
        top = judged[np.argsort(-state.log_ratio[judged], kind="stable")[:k]]
        return [(int(w), math.exp(float(state.log_ratio[w]))) for w in top]


def median_clip(c: float = CLIP_FACTOR, *, window: int = GUARD_WINDOW) -> MedianClip:
    """Clip an update whose weighted norm is more than ``c`` times the median of the other workers'.

    See the module docstring for the reference and the weight. The clipped update keeps its
    direction and gets the weighted norm c × the reference. The window remembers the weighted norm
    the worker sent, not the clipped one: a minority of liars cannot move the upper median (an
    outlier is one value of the sample), while remembering clipped values would let a group of
    honest clients far from their optimum be clipped down to the others' scale for good (two of four
    clients at their optimum would hold the other two at theirs). Its state keeps, per worker, a moving average of the log of each
    judged update's ratio to its reference (``suspicion``): the client manager sets aside a worker
    whose updates stay far above the others' (``fl_rescaled.manager``).
    """
    if not 1 <= c < math.inf:
        raise ValueError(f"the clip factor must be a finite number of at least 1, got {c!r}")
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= 100_000:
        raise ValueError(f"the median clip's window must be an integer in 1..100000, got {window!r}")
    return MedianClip(float(c), window)
