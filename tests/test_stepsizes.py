"""Stepsize rules against the formulas in algorithms.md."""

import math

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
    from fl_rescaled.stepsizes import TauTable, rescaled

    rule = rescaled()
    taus = TauTable(4)  # online: nothing known yet
    taus.update(0, 1.0)
    assert rule(0.8, 0, taus, 0) == pytest.approx(0.8 / 4)  # τ_max = the only known τ
    taus.update(1, 4.0)
    assert rule(0.8, 1, taus, 0) == pytest.approx(0.8 / 4 * 4 / 4)
    assert rule(0.8, 0, taus, 0) == pytest.approx(0.8 / 4 * 1 / 4)
    weighted = TauTable(4, weights=[0.1, 0.2, 0.3, 0.4])
    weighted.update(0, 1.0)
    weighted.update(1, 4.0)
    assert rule(0.8, 1, weighted, 0) == pytest.approx(0.8 * 0.2 * 4 / 4)
    weighted.set_active(2, False)
    weighted.set_active(3, False)  # 2 and 3 left: weights renormalised over the online ones
    assert rule(0.8, 1, weighted, 0) == pytest.approx(0.8 * (0.2 / 0.3) * 4 / 4)
    weighted.set_active(1, False)  # its last reply still counts with its own τ (above τ_max now)
    assert rule(0.8, 1, weighted, 0) == pytest.approx(0.8 * (0.2 / 0.1) * 4 / 4)


def test_tau_table_statistics_follow_changes_exactly_enough():
    """τ_max and τ_H of the active, known workers, kept up to date incrementally (O(log n) per change)."""
    import math

    import numpy as np

    from fl_rescaled.stepsizes import TauTable, harmonic_mean

    rng = np.random.default_rng(0)
    n = 50
    table, taus, active = TauTable(n), [math.nan] * n, [True] * n
    for step in range(2000):
        i = int(rng.integers(n))
        if rng.random() < 0.1:
            active[i] = not active[i]
            table.set_active(i, active[i])
        else:
            taus[i] = float(rng.uniform(0.5, 20.0))
            table.update(i, taus[i])
        known = [t for t, a in zip(taus, active) if a and not math.isnan(t)]
        if known:
            assert table.tau_max == max(known)
            assert table.tau_h == pytest.approx(harmonic_mean(known), rel=1e-9)
            assert table.n_known == len(known) and table.n_active == sum(active)
    fixed = TauTable(4, [1.0, 2.0, 4.0, 4.0])
    assert (fixed.tau_max, fixed.tau_h) == (4.0, harmonic_mean([1.0, 2.0, 4.0, 4.0]))
    with pytest.raises(RuntimeError):
        fixed.update(0, 3.0)


def test_rules_compose_and_match_the_formulas():
    from fl_rescaled.stepsizes import RULES, TauTable, authors, inverse, polynomial, scaled_by, vanilla

    taus = TauTable(len(TAUS), TAUS)
    for i in range(len(TAUS)):
        assert RULES["rescaled"]()(0.3, i, taus, 7) == rescaled_stepsize(i, TAUS, 0.3)
        assert RULES["vanilla"]()(0.3, i, taus, 7) == vanilla_stepsize(TAUS, 0.3)
    gamma = vanilla_stepsize(TAUS, 0.3)
    for delay in (0, 4, 10, 40):
        assert RULES["delay-adaptive"]()(0.3, 0, taus, delay) == delay_adaptive_stepsize(gamma, delay, 10)
        assert RULES["delay-adaptive"]("authors")(0.3, 0, taus, delay) == delay_adaptive_stepsize(gamma, delay, 10, "authors")
        assert scaled_by(vanilla(), inverse())(0.3, 0, taus, delay) == gamma / (1 + delay)
        assert scaled_by(vanilla(), authors())(0.3, 0, taus, delay) == gamma * 10 / max(10, delay)
        assert scaled_by(vanilla(), polynomial(0.5))(0.3, 0, taus, delay) == pytest.approx(gamma / math.sqrt(1 + delay))


def test_damped_rescaled_is_a_strategy_with_its_option_everywhere():
    from conftest import TOY1_EQUAL, toy1

    from fl_rescaled.stepsizes import TauTable, damped_rescaled
    from fl_rescaled.strategies import options

    taus = TauTable(len(TAUS), TAUS)
    assert damped_rescaled(0.5)(0.3, 4, taus, 3) == pytest.approx(rescaled_stepsize(4, TAUS, 0.3) / 2)
    assert damped_rescaled(0.0)(0.3, 4, taus, 3) == rescaled_stepsize(4, TAUS, 0.3)
    (option,) = options.strategy_options("damped-rescaled")  # --damped-rescaled-exponent, run config too
    assert (option.key, option.default) == ("damped-rescaled-exponent", 0.5)
    assert options.parse_options("damped-rescaled", "exponent=1") == {"exponent": 1.0}
    # The first toy (τ = 1, 2): the discount tilts Rescaled's equal-weight point −2/3 toward the
    # fast worker's minimiser 4, and more so the larger p.
    x = [toy1("damped-rescaled", options={"exponent": p}, lr=0.01, budget=3000)["final_params"][0]
         for p in (0.0, 0.5, 1.0)]
    assert x[0] == pytest.approx(TOY1_EQUAL, abs=0.02) and x[0] < x[1] < x[2] < 4


@pytest.mark.parametrize("taus", [[1, 1, 1, 1, 100], [1, 1, 2, 3, 100, 200], [1, 2, 3, 50, 60, 70], TAUS])
def test_the_bounded_rescaled_rule_is_the_formula_with_tau_max_capped_at_max_ratio_times_the_median(taus):
    """Rescaled ASGD's default rule (max_ratio = 10): γ_i = α · w_i · min(τ_i, τ_ref) / τ_ref with
    τ_ref = min(τ_max, 10 · median τ). With no τ far above the median it is the plain rule."""
    import numpy as np

    from fl_rescaled.stepsizes import TauTable, rescaled

    table = TauTable(len(taus), taus)
    ref = min(max(taus), 10 * float(np.median(taus)))
    for i, tau in enumerate(taus):
        expected = 0.3 * (1 / len(taus)) * min(tau, ref) / ref
        assert rescaled(10)(0.3, i, table, 5) == pytest.approx(expected, rel=1e-12)
        if ref == max(taus):
            assert rescaled(10)(0.3, i, table, 5) == pytest.approx(rescaled_stepsize(i, taus, 0.3), rel=1e-12)
