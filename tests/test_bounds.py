"""Update bounds: each bound's arithmetic against its formula, the options that build them, and a run
with one hostile node (``tests/hostile.py``) for every strategy: the model ends where the honest run's
does, the hostile replies are booked as ``rejected.outlier``, the run completes; a checkpointed run
resumes with the same bound state."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

import hostile
from fl_rescaled import AsyncClientManager, ModelLayout, RejectedReply
from fl_rescaled.bounds import (CLIP_FACTOR, OUTLIER_FACTOR, AdaptiveClipState, Chain, GuardState, MedianClipState,
                                adaptive_clip, adaptive_clip_next, chain, clip, finite_norm, lower_median, median_clip,
                                of_options, outlier_guard, update_norm)
from fl_rescaled.peer_bounds import SUSPICION_RATE, reference
from fl_rescaled.runstate import Checkpointing, load
from fl_rescaled.strategies import STRATEGIES, RescaledASGD, options
from conftest import run_of, start_run


# ================================================================================ the arithmetic
@pytest.mark.parametrize("size", [3, 50])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_update_norm_is_the_l2_norm_in_float64_even_when_the_squares_overflow(dtype, size):
    rng = np.random.default_rng(0)
    g = rng.standard_normal(size).astype(dtype)
    assert update_norm(g) == pytest.approx(float(np.linalg.norm(g.astype(np.float64))), rel=1e-3)
    big = np.full(size, np.finfo(dtype).max, dtype)  # its squares overflow the type: the norm does not
    assert update_norm(big) == pytest.approx(math.sqrt(size) * float(np.finfo(dtype).max), rel=1e-6)
    assert update_norm(np.zeros(size, dtype)) == 0.0


@pytest.mark.parametrize("size", [3, 50, 101770])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_finite_norm_is_update_norm_or_none_when_a_value_is_not_finite(dtype, size):
    """The validation's finiteness test and the bounds' norm in one pass: the same bits as
    ``update_norm`` for a finite update (squares that overflow too), None for NaN or ±inf anywhere."""
    rng = np.random.default_rng(1)
    for g in (rng.standard_normal(size).astype(dtype), np.full(size, np.finfo(dtype).max, dtype),
              np.zeros(size, dtype), np.r_[np.finfo(dtype).max, np.zeros(size - 1)].astype(dtype)):
        assert finite_norm(g) == update_norm(g)  # (inf for both past float64's max)
    for bad in (np.nan, np.inf, -np.inf):
        for where in (0, size // 2, size - 1):
            g = rng.standard_normal(size).astype(dtype)
            g[where] = bad
            assert finite_norm(g) is None
            g[:] = np.finfo(dtype).max  # (with squares that overflow besides)
            g[where] = bad
            assert finite_norm(g) is None


def test_lower_median():
    assert lower_median([5.0]) == 5.0
    assert lower_median([3.0, 1.0]) == 1.0
    assert lower_median([3.0, 1.0, 2.0]) == 2.0
    assert lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0


def test_clip_scales_to_max_norm_only_above_it():
    c = clip(2.0)
    state = c.init()
    g = np.array([3.0, 4.0])  # ‖g‖ = 5
    out, norm = c(state, g, 5.0, 0)
    np.testing.assert_allclose(out, g * 2.0 / 5.0)
    assert norm == 2.0 and update_norm(out) == pytest.approx(2.0) and state.clipped == 1
    small = np.array([0.6, 0.8])
    out, norm = c(state, small, 1.0, 0)
    assert out is small and norm == 1.0 and state.clipped == 1
    f32 = np.full(3, 1e38, np.float32)
    out, norm = c(state, f32, update_norm(f32), 0)
    assert out.dtype == np.float32 and update_norm(out) == pytest.approx(2.0, rel=1e-6)


def test_adaptive_clip_follows_the_geometric_update():
    q, eta = 0.3, 0.2
    b = adaptive_clip(q, rate=eta)
    state = b.init()
    assert math.isnan(state.clip)
    norms = [1.0, 4.0, 0.5, 2.0, 2.0, 0.1]
    c, clipped = None, 0
    for n in norms:
        c_used = n if c is None else c  # the first update's norm when no initial C is given
        g = np.array([n, 0.0])
        out, norm = b(state, g, n, 0)
        assert norm == pytest.approx(min(n, c_used)) and update_norm(out) == pytest.approx(min(n, c_used))
        c = c_used * math.exp(-eta * ((1.0 if n <= c_used else 0.0) - q))
        clipped += n > c_used
        assert state.clip == pytest.approx(c)
    assert state.seen == len(norms) and state.clipped == clipped >= 2
    assert adaptive_clip_next(2.0, True, 0.5, 0.2) == pytest.approx(2.0 * math.exp(-0.1))
    assert adaptive_clip_next(2.0, False, 0.5, 0.2) == pytest.approx(2.0 * math.exp(0.1))
    given = adaptive_clip(0.5, initial=3.0)
    assert given.init().clip == 3.0


def test_adaptive_clip_settles_at_the_quantile():
    rng = np.random.default_rng(1)
    b = adaptive_clip(0.8, rate=0.05, initial=100.0)
    state = b.init()
    norms = rng.exponential(1.0, 20000)
    for n in norms:
        b(state, np.array([n]), float(n), 0)
    assert state.clip == pytest.approx(-math.log(1 - 0.8), rel=0.15)  # the exponential's 0.8 quantile


def test_outlier_guard_compares_with_the_lower_median_of_the_others_and_the_candidate():
    k = 10.0
    g = outlier_guard(k, window=3)
    s = g.init()
    one = np.ones(1)
    g(s, one, 1.0, 0)  # a sample of one or two norms is not judged
    g(s, one, 9.0, 1)
    g(s, one, 89.0, 2)  # {1, 9} of the others, and 89: the median is 9, and 89 ≤ 10 × 9
    with pytest.raises(RejectedReply) as exc:  # {9, 89} of the others, and 950: the median is 89
        g(s, one, 950.0, 0)
    assert exc.value.reason == "outlier" and "950" in exc.value.detail and "× 89," in exc.value.detail
    assert s.norms == {0: 1.0, 1: 9.0, 2: 89.0}  # (a rejected norm is not remembered)
    g(s, one, 2.0, 0)  # worker 0's entry is replaced and becomes the most recent
    assert list(s.norms.items()) == [(1, 9.0), (2, 89.0), (0, 2.0)]
    g(s, one, 3.0, 3)  # {2, 3, 9, 89}: the lower median is 3; a fourth worker: the oldest (1) is forgotten
    assert list(s.norms.items()) == [(2, 89.0), (0, 2.0), (3, 3.0)]
    with pytest.raises(RejectedReply):  # {2, 3, 31, 89}: the lower median is 3
        g(s, one, 31.0, 1)
    g(s, one, 29.0, 1)
    assert s.rejected == 2
    zero = np.zeros(1)
    assert g(s, zero, 0.0, 4)[0] is zero and 4 not in s.norms  # a zero update: passed, not remembered


def test_a_workers_own_earlier_norm_does_not_vouch_for_it():
    g = outlier_guard(10.0)
    s = g.init()
    for worker, norm in [(3, 1000.0), (0, 1.0), (1, 2.0), (2, 8.0)]:  # worker 3's first reply: not judged
        g(s, np.ones(1), norm, worker)
    with pytest.raises(RejectedReply):  # {1, 2, 8} of the others, and 50: the median is 2 (with its own 1000: 8)
        g(s, np.ones(1), 50.0, 3)


def test_a_single_outlier_from_the_third_reply_on_is_never_the_median():
    g = outlier_guard(100.0)
    for position in range(5):  # the reply at ``position`` is 1e38, the others honest
        s = g.init()
        honest = iter([1.0, 1.3, 0.8, 1.1, 0.9])
        for i in range(5):
            if i != position:
                g(s, np.ones(1), next(honest), i)
            elif position >= 2:
                with pytest.raises(RejectedReply):
                    g(s, np.ones(1), 1e38, i)
            else:  # the limit: the first two replies are not judged
                g(s, np.ones(1), 1e38, i)
        assert (max(s.norms.values()) < 2) == (position >= 2)


def test_chain_applies_in_order_and_a_rejection_stops_it():
    ch = chain(outlier_guard(10.0), chain(adaptive_clip(0.5, initial=1.0), clip(0.5)))
    assert [type(b).__name__ for b in ch.bounds] == ["OutlierGuard", "AdaptiveClip", "Clip"]
    states = ch.init()
    out = ch.apply(states, np.array([3.0, 4.0]), 0)  # guard: first, passes; adaptive: to 1; clip: to 0.5
    assert update_norm(out) == pytest.approx(0.5) and states[1].clipped == 1 and states[2].clipped == 1
    before = (states[1].clip, states[1].seen, states[2].clipped)
    ch.apply(states, np.array([0.1, 0.0]), 1)
    with pytest.raises(RejectedReply):
        ch.apply(states, np.array([1e6, 0.0]), 2)
    assert states[1].seen == before[1] + 1  # the rejected update never reached the clips
    ch.check(states)
    with pytest.raises(ValueError, match="not this run's"):
        ch.check([GuardState(), AdaptiveClipState()])


def test_options_build_the_chain_and_are_validated():
    assert [type(b).__name__ for b in of_options().bounds] == ["OutlierGuard", "MedianClip"]
    assert of_options().bounds[0].factor == OUTLIER_FACTOR and of_options().bounds[1].factor == CLIP_FACTOR == 1.5
    assert of_options(outlier_factor=None, clip_factor=None).bounds == ()
    s = RescaledASGD(outlier_factor=None, clip_factor=None, adaptive_clip=0.9, clip_norm=3.0)
    assert [type(b).__name__ for b in s.bounds.chain().bounds] == ["AdaptiveClip", "Clip"]
    for bad in ({"outlier_factor": 1.0}, {"outlier_factor": -5.0}, {"clip_norm": 0.0}, {"clip_norm": math.inf},
                {"adaptive_clip": 1.0}, {"adaptive_clip": 0.0}, {"clip_factor": 0.5}, {"clip_factor": math.inf}):
        with pytest.raises(ValueError):
            RescaledASGD(**bad)
    keys = {o.key for o in options.common_options()}
    assert {"outlier-factor", "clip-factor", "adaptive-clip", "clip-norm"} <= keys
    assert options.parse_options("rescaled", "outlier-factor=none clip-norm=2 clip-factor=none") == {
        "outlier_factor": None, "clip_norm": 2.0, "clip_factor": None}


def test_median_clip_weighs_norms_clips_to_c_times_the_upper_median_and_keeps_a_moving_ratio():
    c = median_clip(2.0)
    s = c.init()
    one = np.ones(1)
    for worker, norm in [(0, 1.0), (1, 4.0)]:  # fewer than two others: nothing judged
        out, kept = c(s, one * norm, norm, worker)
        assert kept == norm and s.judged.sum() == 0
    # worker 2: the others' {1, 4} and its own 20: the upper median is 4, so 20 is clipped to 8
    out, kept = c(s, np.array([20.0]), 20.0, 2)
    assert kept == 8.0 and out[0] == pytest.approx(8.0) and s.clipped == 1 and s.latest[2] == 20.0  # (as sent)
    assert s.log_ratio[2] == pytest.approx(SUSPICION_RATE * math.log(20.0 / 4.0))
    # a weight (share) of 1/4: a norm of 40 weighs 10; the others' {4, 20} and 10: the upper median is 10
    out, kept = c(s, np.array([40.0]), 40.0, 0, share=0.25)
    assert kept == pytest.approx(40.0) and s.clipped == 1  # (not clipped)
    out, kept = c(s, np.array([400.0]), 400.0, 0, share=0.25)  # weighs 100; {4, 20} and 100: 2 × 20, a norm of 160
    assert kept == pytest.approx(160.0) and out[0] == pytest.approx(160.0) and s.latest[0] == pytest.approx(100.0)
    judged, ratio = c.suspicion(s, 0)
    assert judged == 2 and ratio > 1 and c.suspicion(s, 7) == (0, 1.0)
    assert sorted(w for w, _ in c.largest(s, 2)) == [0, 2] and len(c.largest(s, 5)) == 2
    zero = np.zeros(1)
    assert c(s, zero, 0.0, 5)[0] is zero and 5 not in s.latest
    s.check()
    with pytest.raises(ValueError):
        median_clip(0.9)


def test_the_upper_median_keeps_a_population_split_in_half():
    """Two clients at their optimum (tiny norms) and two far from theirs: the far ones are judged by
    the upper median of the others, one of their own kind, and are not clipped to the near ones'."""
    c = median_clip(1.5)
    s = c.init()
    for w, norm in [(0, 1e-3), (2, 4.0), (1, 1e-3), (3, 4.0)] * 3:
        _, kept = c(s, np.array([norm]), norm, w)
        assert kept == pytest.approx(norm)
    assert s.clipped == 0 and s.judged.sum() == 10
    assert reference(s.latest, 2, 4.0, upper=True)[0] == 4.0 and reference(s.latest, 2, 4.0)[0] == 1e-3


# ================================================================================ one hostile node
@functools.lru_cache(maxsize=None)
def honest(strategy: str, reply: str) -> np.ndarray:
    x, books = hostile.run(strategy, reply, hostile.HostileGrid())
    assert x is not None and books["updates"] == hostile.UPDATES and not any(k.startswith("rejected.") for k in books)
    return x


def assert_outliers_only_from(books: dict, worker: int) -> None:
    rejected = books["rejected-per-worker"]
    assert rejected[worker] > 0 and sum(rejected) == rejected[worker], books
    assert books.get("rejected.outlier") == rejected[worker], books


@pytest.mark.parametrize("mode", hostile.MODES)
@pytest.mark.parametrize("strategy,reply", hostile.cases())
def test_one_hostile_node_of_four_cannot_move_the_model(strategy, reply, mode):
    x, books = hostile.run(strategy, reply, hostile.HostileGrid(mode))
    assert x is not None, books.get("failed")
    assert books["updates"] == hostile.UPDATES and books["balanced"] == 1
    assert hostile.distance(x, honest(strategy, reply)) < 0.1
    assert_outliers_only_from(books, hostile.HOSTILE_NODE)


@pytest.mark.parametrize("strategy,reply", [("rescaled", "gradient"), ("rescaled", "model"), ("malenia", "gradient"),
                                            ("fedbuff", "model")])
def test_a_hostile_third_reply_is_rejected(strategy, reply):
    x, books = hostile.run(strategy, reply, hostile.HostileGrid(at=3))
    assert x is not None and books["rejected.outlier"] == 1 and books["updates"] == hostile.UPDATES
    assert hostile.distance(x, honest(strategy, reply)) < 0.1


def test_a_hostile_first_reply_stops_the_run_loudly_and_clip_norm_bounds_it():
    """The first reply of a run has nothing to be compared with: it is applied, the replies computed
    on the model it ruined are outliers of the first ones, and the run stops (``RunFailed``) instead
    of reporting a ruined model. An a-priori ``clip_norm`` bounds even that reply."""
    x, books = hostile.run("rescaled", "gradient", hostile.HostileGrid(at=1))
    # (it stops once three of the four clients have had three replies in a row rejected)
    assert x is None and "outlier" in books["failed"] and books["rejected.outlier"] >= 9
    assert "3 of 4 clients failed" in books["failed"]
    x, books = hostile.run("rescaled", "gradient", hostile.HostileGrid(at=1), clip_norm=5.0)
    assert x is not None and books["updates"] == hostile.UPDATES
    assert hostile.distance(x, honest("rescaled", "gradient")) < 0.1


def test_the_guard_off_lets_the_hostile_node_ruin_the_model():
    """The scenario can tell: without the guard (and the median clip), a node replying 1e6 moves the
    model by ~1e5."""
    x, books = hostile.run("rescaled", "gradient", hostile.HostileGrid("1e6"), outlier_factor=None, clip_factor=None)
    assert x is not None and hostile.distance(x, honest("rescaled", "gradient")) > 1e3


def test_a_checkpointed_run_resumes_with_the_same_bound_state(tmp_path):
    """A run with the guard and an adaptive clip (both learn during the run) written to a checkpoint
    every 50 time units, then resumed from its last checkpoint: the bound states read back are the
    ones written, and the resumed run ends bit for bit where the uninterrupted one did, with the same
    bound states."""
    def start(resume: bool):
        s = STRATEGIES["rescaled"](adaptive_clip=0.7)
        plan = Checkpointing(tmp_path / "run.ckpt", 50.0, "bounds-test", resume=resume)
        res = start_run(s, hostile.HostileGrid("x1000"), ArrayRecord({"w": Array(np.zeros(hostile.DIM, np.float32))}),
                      time_budget=180.0, clock=hostile.VirtualClock(hostile.DelayModel(hostile.TAUS)),
                      train_config={"reply": "gradient"}, partition_query=True, checkpoint=plan)
        return s, res

    first, res1 = start(False)
    saved = load(Checkpointing(tmp_path / "run.ckpt", 50.0, "bounds-test").covering(
        first, run_of(first).layout, 180.0, None), first.State).manager.bounds
    guard, median, adaptive = saved
    assert isinstance(guard, GuardState) and guard.rejected > 0 and sorted(guard.norms) == [0, 1, 3]  # (not 2)
    assert isinstance(median, MedianClipState) and median.judged.sum() > 0
    assert isinstance(adaptive, AdaptiveClipState) and adaptive.seen > 0 and math.isfinite(adaptive.clip)
    second, res2 = start(True)
    assert run_of(second).manager.bound_state is not run_of(first).manager.bound_state
    assert res2.arrays["w"].numpy().tobytes() == res1.arrays["w"].numpy().tobytes()
    assert run_of(second).manager.bound_state == run_of(first).manager.bound_state
    assert isinstance(run_of(second).manager.bound, Chain)


def test_batched_replicas_apply_no_bound():
    """A batch's replicas differ only in α and a rejection is per reply, not per replica: batches
    apply no bound (documented on ``AsyncStrategy``)."""
    layout = ModelLayout.of(ArrayRecord({"w": Array(np.zeros(2 * hostile.DIM))}))[0]
    clock = hostile.VirtualClock(hostile.DelayModel(hostile.TAUS))
    bound = of_options(clip_norm=1.0)
    assert AsyncClientManager(hostile.HostileGrid(), clock, layout=layout, replicas=2, bound=bound).bound is None
    assert AsyncClientManager(hostile.HostileGrid(), clock, layout=layout, replicas=1, bound=bound).bound is bound
