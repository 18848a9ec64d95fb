"""Stepsize rules against the formulas in algorithms.md."""

import pytest

from fl_rescaled.stepsizes import check_weights, delay_adaptive_stepsize, rescaled_stepsize, vanilla_stepsize

TAUS = [1, 1, 2, 2, 4, 4, 8, 8, 16, 16]


def test_rescaled_formula():
    for i, tau in enumerate(TAUS):
        assert rescaled_stepsize(i, TAUS, 0.3) == pytest.approx(0.3 * (1 / 10) * tau / 16)
    w = [0.5, 0.25, 0.25]
    assert rescaled_stepsize(2, [1, 2, 4], 1.0, w) == pytest.approx(0.25 * 4 / 4)
    assert rescaled_stepsize(0, [1, 2, 4], 1.0, w) == pytest.approx(0.5 * 1 / 4)


def test_vanilla_formula_is_alpha_over_K_for_harmonic_taus():
    K = sum(16 / t for t in TAUS)  # gradients per τ_max cycle = 62
    assert vanilla_stepsize(TAUS, 2.0) == pytest.approx(2.0 / K)
    n = len(TAUS)
    tau_h = n / sum(1 / t for t in TAUS)
    assert vanilla_stepsize(TAUS, 2.0) == pytest.approx(2.0 * tau_h / (n * 16))


@pytest.mark.parametrize("taus", [TAUS, [1, 2], [1, 100], [4, 4, 4]])
def test_one_harmonic_cycle_sums_to_alpha(taus):
    alpha, tmax = 0.7, max(taus)
    counts = [tmax / t for t in taus]  # deliveries of each worker in one τ_max cycle
    rescaled = sum(k * rescaled_stepsize(i, taus, alpha) for i, k in enumerate(counts))
    vanilla = sum(k * vanilla_stepsize(taus, alpha) for k in counts)
    assert rescaled == pytest.approx(alpha)
    assert vanilla == pytest.approx(alpha)
    # Rescaled gives every worker the same share α/n per cycle; Vanilla ∝ 1/τ_i.
    shares = [k * rescaled_stepsize(i, taus, alpha) for i, k in enumerate(counts)]
    assert shares == pytest.approx([alpha / len(taus)] * len(taus))


def test_cumulative_stepsize_of_a_run_grows_at_alpha_per_tau_max():
    from conftest import quad

    taus = [1, 2, 4]
    for strategy in ("rescaled", "vanilla"):
        out = quad(strategy=strategy, taus=taus, quad_a=[1, 1, 1], quad_b=[0, 1, 2], lr=0.5, budget=400)
        assert out["cumulative_stepsize"] == pytest.approx(0.5 * 400 / 4)


def test_delay_adaptive_rules():
    assert delay_adaptive_stepsize(0.2, 0, 10) == pytest.approx(0.2)
    assert delay_adaptive_stepsize(0.2, 4, 10) == pytest.approx(0.2 / 5)
    assert delay_adaptive_stepsize(0.2, 4, 10, "authors") == pytest.approx(0.2)
    assert delay_adaptive_stepsize(0.2, 10, 10, "authors") == pytest.approx(0.2)
    assert delay_adaptive_stepsize(0.2, 40, 10, "authors") == pytest.approx(0.2 * 10 / 40)
    with pytest.raises(ValueError):
        delay_adaptive_stepsize(0.2, -1, 10)
    with pytest.raises(ValueError):
        delay_adaptive_stepsize(0.2, 1, 10, "other")


def test_weights_validation():
    assert check_weights([0.5, 0.5], 2) == (0.5, 0.5)
    with pytest.raises(ValueError):
        check_weights([0.5, 0.6], 2)
    with pytest.raises(ValueError):
        check_weights([1.0], 2)


def test_wall_clock_rescaled_weights_count_workers_not_heard_from_yet():
    """On the wall clock τ_i is estimated online. Workers that have not delivered yet still count in
    the weights (1/n each), so the first replies of a run take steps of α/n, not α/1, α/2, ..."""
    import math
    from types import SimpleNamespace

    from fl_rescaled import RescaledASGD

    taus = [1.0, math.nan, math.nan, math.nan]
    manager = SimpleNamespace(clock=SimpleNamespace(virtual=False), tau_estimates=lambda: taus,
                              online_workers=lambda: [0, 1, 2, 3])
    s = RescaledASGD(lr=0.8)
    s.manager = manager
    assert s.stepsize(SimpleNamespace(worker=0)) == pytest.approx(0.8 / 4)  # τ_max = the only known τ
    taus[1] = 4.0
    assert s.stepsize(SimpleNamespace(worker=1)) == pytest.approx(0.8 / 4 * 4 / 4)
    assert s.stepsize(SimpleNamespace(worker=0)) == pytest.approx(0.8 / 4 * 1 / 4)
    w = RescaledASGD(lr=0.8, weights=[0.1, 0.2, 0.3, 0.4])
    w.manager = manager
    assert w.stepsize(SimpleNamespace(worker=1)) == pytest.approx(0.8 * 0.2 * 4 / 4)
    manager.online_workers = lambda: [0, 1]  # 2 and 3 left: weights renormalised over the online ones
    assert w.stepsize(SimpleNamespace(worker=1)) == pytest.approx(0.8 * (0.2 / 0.3) * 4 / 4)
