"""The paper's two toy problems (experiments.md): fixed points of Rescaled, Vanilla and Delay-Adaptive."""

from conftest import TOY1_EQUAL, TOY1_FREQUENCY, quad, toy1


def test_vanilla_is_inconsistent_rescaled_is_not():
    # The first toy, α=0.01: equal-weight minimiser −2/3, frequency-weighted +1/2 (conftest.TOY1).
    r = toy1("rescaled", lr=0.01, budget=4000, eval_every=100)
    v = toy1("vanilla", lr=0.01, budget=4000, eval_every=100)
    assert abs(r["final_params"][0] - TOY1_EQUAL) < 0.05
    assert abs(v["final_params"][0] - TOY1_FREQUENCY) < 0.05
    # Each converged: the last evaluations barely move.
    for out in (r, v):
        xs = [h["dist"] for h in out["history"][-10:]]
        assert max(xs) - min(xs) < 1e-3


def test_delay_adaptive_is_biased_toward_fast_worker():
    # τ=(1,100), F1=(x−1)², F2=(x+1)²: Delay-Adaptive ends near +1; Rescaled near 0 (start at 5).
    common = dict(taus=[1, 100], quad_a=[1, 1], quad_b=[1, -1], lr=0.1, budget=20000, quad_x0=5.0)
    da = quad(strategy="delay-adaptive", **common)
    rs = quad(strategy="rescaled", **common)
    assert da["final_params"][0] > 0.8
    assert abs(rs["final_params"][0]) < 0.1


def test_fixed_point_formula_matches_simulation():
    # A quadratic with 3 workers: Rescaled lands on Σ a_i b_i / Σ a_i, Vanilla on the 1/τ-weighted point.
    from fl_rescaled.tasks import QuadraticTask

    taus, a, b = [1, 2, 4], [1.0, 3.0, 2.0], [2.0, -1.0, 5.0]
    task = QuadraticTask(a, b)
    common = dict(taus=taus, quad_a=a, quad_b=b, lr=0.01, budget=8000, quad_x0=-3.0)
    r = quad(strategy="rescaled", **common)
    v = quad(strategy="vanilla", **common)
    assert abs(r["final_params"][0] - task.fixed_point([1, 1, 1])) < 0.02
    assert abs(v["final_params"][0] - task.fixed_point([1 / t for t in taus])) < 0.02
    assert abs(task.fixed_point([1, 1, 1]) - task.minimizer) < 1e-12
