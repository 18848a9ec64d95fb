"""Differential privacy (``strategies/dp.py``, ``fl_rescaled/privacy.py``, ``docs/privacy.md``): the
noise's standard deviation, the clip, the accountant against the library and a published formula,
per-client budgets, Flower's wrappers refused with the way forward, and the accountant's state in
checkpoints (a resumed run reports the same ε as an uninterrupted one)."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

import dp_accounting as dpa  # (part of the test extra: a missing one fails the run, it is never skipped)
from fl_rescaled import experiment
from fl_rescaled.manager import ManagerObserver
from fl_rescaled.codec import StateError, decode, encode
from fl_rescaled.privacy import AdaptiveClipping, PrivacyState, default_delta, epsilon, update_noise_multiplier
from fl_rescaled.runspec import RunSpec
from fl_rescaled.strategies import STRATEGIES, AsyncDPAdaptiveClipping, AsyncDPFixedClipping
from scripted import ScriptedRun

QUAD = dict(task="quadratic", taus=[1.0, 2.0, 4.0, 8.0], quad_a=[1.0, 1.0, 1.0, 1.0], quad_b=[0.0, 1.0, 2.0, 3.0],
            quad_dim=20, quad_x0=50.0, budget=200.0, seed=3)


def quad_run(strategy: str = "rescaled", **dp) -> dict:
    return experiment.run(RunSpec(strategy=strategy, **QUAD, **dp))


# ------------------------------------------------------------------------------------------------ the noise
def test_the_noise_on_an_applied_update_has_the_stated_standard_deviation():
    """A zero update through the wrapper and Vanilla ASGD: what is applied is the noise alone.

    With d = 400,000 draws of N(0, σ²), the sample standard deviation s has sd ≈ σ / √(2d) and the
    mean sd σ / √d; each bound below is 6 of those (a false failure: about 2e-9 each)."""
    sigma_z, clip, d = 0.8, 2.5, 400_000
    s = AsyncDPFixedClipping(STRATEGIES["vanilla"](lr=1.0), noise_multiplier=sigma_z, clipping_norm=clip, seed=7)
    run = ScriptedRun(n=1, x=np.zeros(d))
    run.start(s)
    run.deliver(s, 0, np.zeros(d))
    (step,) = run.steps
    noise, sigma = step.update, sigma_z * clip
    assert abs(noise.std() / sigma - 1) < 6 / math.sqrt(2 * d)
    assert abs(noise.mean()) < 6 * sigma / math.sqrt(d)
    assert run.strategy_state.privacy.contributions() == [1]


def test_without_noise_multiplier_the_update_is_applied_as_it_is_and_epsilon_is_infinite():
    s = AsyncDPFixedClipping(STRATEGIES["vanilla"](lr=1.0), noise_multiplier=0.0, clipping_norm=1.0)
    run = ScriptedRun(n=2, x=np.zeros(3))
    run.start(s)
    run.deliver(s, 1, [0.1, 0.2, 0.3])
    np.testing.assert_array_equal(run.steps[0].update, [0.1, 0.2, 0.3])
    assert s.report(run.strategy_state)["epsilon"] == [0.0, math.inf]


def test_fedbuff_gets_one_noise_draw_per_buffer_on_the_sum():
    """K = 2 buffered updates, one release: the noise is added once, to the sum, before dividing by K."""
    s = AsyncDPFixedClipping(STRATEGIES["fedbuff"](buffer_size=2, staleness_exponent=0.0), noise_multiplier=1.0,
                             clipping_norm=1.0, seed=1)
    run = ScriptedRun(n=2, x=np.zeros(200_000))
    run.start(s)
    run.deliver(s, 0, np.full(200_000, 0.5))
    assert not run.steps
    run.deliver(s, 1, np.full(200_000, 0.25))
    (step,) = run.steps
    assert step.stepsize == pytest.approx(0.5)
    noise = step.update - 0.75
    assert abs(noise.std() - 1.0) < 6 / math.sqrt(2 * noise.size)
    assert run.strategy_state.privacy.counts == [{"1": 1}, {"1": 1}]


# ------------------------------------------------------------------------------------------------ clipping
def test_clipping_bounds_every_clients_contribution():
    """Every update the wrapper's bounds let through has norm ≤ C (the outlier guard and the median
    clip off), and a noiseless DP run moves the model by at most C × the cumulative stepsize."""
    s = AsyncDPFixedClipping(STRATEGIES["rescaled"](), noise_multiplier=1.0, clipping_norm=0.3)
    chain = s.bounds.chain()
    states = chain.init()
    rng = np.random.default_rng(0)
    for worker in range(50):
        g = rng.normal(size=100) * rng.uniform(0.01, 100)
        assert np.linalg.norm(chain.apply(states, g, worker % 4)) <= 0.3 * (1 + 1e-12)
    assert (s.outlier_factor, s.clip_factor) == (None, None)  # (the inner strategy keeps its own)
    clip = 0.05
    private = quad_run(dp_noise_multiplier=0.0, dp_clipping_norm=clip)
    plain = quad_run()
    x0 = np.full(20, 50.0)
    moved = np.linalg.norm(np.array(private["final_params"]) - x0)
    assert moved <= clip * private["cumulative_stepsize"] * (1 + 1e-9)
    assert np.linalg.norm(np.array(plain["final_params"]) - x0) > 10 * moved  # (the clip did something)


# ------------------------------------------------------------------------------------------------ the accountant
def library_epsilon(k: int, z: float, delta: float) -> float:
    accountant = dpa.rdp.RdpAccountant()
    accountant.compose(dpa.GaussianDpEvent(z), k)
    return accountant.get_epsilon(delta)


def test_epsilon_is_the_librarys_for_the_logged_counts():
    out = quad_run(dp_noise_multiplier=2.0, dp_clipping_norm=1.0)
    dp = out["dp"]
    assert dp["delta"] == default_delta(4) == 1e-5
    assert dp["contributions"] == out["updates_per_worker"]
    assert sum(dp["contributions"]) == out["num_updates"] == dp["releases"]
    for k, eps in zip(dp["contributions"], dp["epsilon"]):
        assert eps == pytest.approx(library_epsilon(k, 2.0, 1e-5), rel=1e-9)
    assert dp["max_epsilon"] == max(dp["epsilon"])
    assert out["history"][-1]["dp_epsilon_per_worker"] == dp["epsilon"]  # (and per evaluation point, non-decreasing)
    per_point = np.array([h["dp_epsilon_per_worker"] for h in out["history"]])
    assert (np.diff(per_point, axis=0) >= 0).all() and out["history"][-1]["dp_max_epsilon"] == dp["max_epsilon"]
    assert dp["mean_epsilon"] == pytest.approx(np.mean(dp["epsilon"]))
    # a fast client (τ = 1) contributes more often, and pays more, than a slow one (τ = 8)
    assert dp["contributions"][0] > dp["contributions"][3] and dp["epsilon"][0] > dp["epsilon"][3]


def analytic_gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact ε of a μ-GDP mechanism (a Gaussian of sensitivity 1 and noise 1/μ; k of noise z
    compose to μ = √k / z): the smallest ε with Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) ≤ δ (Balle & Wang,
    "Improving the Gaussian Mechanism for Differential Privacy", ICML 2018, Theorem 8; Dong, Roth &
    Su 2022, Corollary 2.13)."""
    phi = lambda t: 0.5 * math.erfc(-t / math.sqrt(2))  # noqa: E731
    lo, hi = 0.0, 100.0
    for _ in range(200):
        eps = (lo + hi) / 2
        if phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2) > delta:
            lo = eps
        else:
            hi = eps
    return hi


@pytest.mark.parametrize("k,z", [(1, 1.0), (100, 10.0), (1000, 5.0)])
def test_epsilon_is_sound_and_close_to_the_published_exact_value(k, z):
    """RDP never reports less than the exact ε of the composed Gaussian, and is within 25% of it.
    One standard setting quoted in the literature: z = 1, one release, δ = 1e-5 gives ε ≈ 4.4 exactly
    (the analytic Gaussian mechanism), and the RDP accountant 4.73."""
    exact = analytic_gaussian_epsilon(math.sqrt(k) / z, 1e-5)
    ours = epsilon({1: k}, z, 1e-5)
    assert exact <= ours <= 1.25 * exact
    if (k, z) == (1, 1.0):
        assert exact == pytest.approx(4.4, abs=0.1) and ours == pytest.approx(4.73, abs=0.01)


def test_a_release_with_m_updates_of_one_client_costs_its_sensitivity_m_c():
    """m updates of a client in one buffer: sensitivity m·C, a Gaussian of noise multiplier z / m."""
    accountant = dpa.rdp.RdpAccountant()
    accountant.compose(dpa.GaussianDpEvent(1.0 / 2))
    assert epsilon({2: 1}, 1.0, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5))
    assert epsilon({2: 1}, 1.0, 1e-5) > epsilon({1: 2}, 1.0, 1e-5)


# ------------------------------------------------------------------------------------------------ budgets
@pytest.mark.parametrize("strategy", ["rescaled", "fedbuff", "fedasync"])
def test_a_client_over_budget_is_no_longer_selected_and_the_run_stops_when_too_few_remain(strategy, caplog):
    caplog.set_level(logging.INFO, logger="flwr.fl_rescaled")
    target = 8.0
    out = quad_run(strategy, dp_noise_multiplier=1.0, dp_clipping_norm=1.0, dp_target_epsilon=target)
    dp = out["dp"]
    assert all(e <= target for e in dp["epsilon"])
    assert dp["excluded"] and set(dp["excluded"]) <= {0, 1, 2, 3}
    named = [r.getMessage() for r in caplog.records if "is no longer selected" in r.getMessage()]
    assert len(named) == len(dp["excluded"])  # one line per client
    assert any("privacy budgets spent" in r.getMessage() for r in caplog.records)
    assert out["final_time"] < QUAD["budget"]  # (it stopped before its budget)
    if strategy == "rescaled":  # one update per release: the fast clients reach the budget's count
        most = max(k for k in range(1, 50) if epsilon({1: k}, 1.0, 1e-5) <= target)
        assert max(dp["contributions"]) == most


class Jobs(ManagerObserver):
    """Every job sent, in order, and the order in which the accountant set clients aside."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def job_sent(self, job) -> None:
        self.sent.append(job.worker)


@pytest.mark.parametrize("strategy,clock,selection", [("rescaled", "virtual", "uniform"), ("fedbuff", "virtual", "uniform"),
                                                      ("vanilla", "virtual", "round-robin"), ("fedasync", "wall", "uniform")])
def test_with_c_below_n_the_selection_leaves_out_a_client_over_budget(strategy, clock, selection, caplog):
    """C = 3 of N = 8 clients, uniform or round-robin selection: a client set aside gets no job after the log line
    that names it, every ε stays within the budget, and the run stops when fewer than two remain."""
    caplog.set_level(logging.INFO, logger="flwr.fl_rescaled")
    jobs, target = Jobs(), 10.0
    taus = [1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0]
    spec = dict(QUAD, taus=taus, quad_a=[1.0] * 8, quad_b=[float(i) for i in range(8)], budget=400.0)
    if clock == "wall":
        spec.update(clock="wall", time_unit=0.002, budget=400.0)
    marks: list[int] = []

    class Mark(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "is no longer selected" in record.getMessage():
                marks.append(len(jobs.sent))

    handler = Mark()
    logging.getLogger("flwr.fl_rescaled").addHandler(handler)
    try:
        out = experiment.run(RunSpec(strategy=strategy, **spec, dp_noise_multiplier=1.0, dp_clipping_norm=1.0,
                                     dp_target_epsilon=target, options={"concurrency": 3, "selection": selection}),
                                     observers=[jobs])
    finally:
        logging.getLogger("flwr.fl_rescaled").removeHandler(handler)
    dp = out["dp"]
    assert all(e <= target for e in dp["epsilon"])
    assert len(dp["excluded"]) >= 7  # (the run stops when fewer than min_train_nodes = 2 remain)
    named = [int(r.getMessage().split()[1]) for r in caplog.records if "is no longer selected" in r.getMessage()]
    assert sorted(named) == dp["excluded"] and len(marks) == len(named)
    for worker, at in zip(named, marks):
        assert worker not in jobs.sent[at:]  # (never a job after it was set aside)
    assert any("privacy budgets spent" in r.getMessage() for r in caplog.records)
    assert out["final_time"] < spec["budget"]


# ------------------------------------------------------------------------------------------------ wrapping
@pytest.mark.parametrize("wrapper", ["DifferentialPrivacyServerSideFixedClipping",
                                     "DifferentialPrivacyServerSideAdaptiveClipping"])
@pytest.mark.parametrize("private", [False, True])
def test_flowers_dp_wrapper_around_ours_is_refused_at_start_naming_ours(wrapper, private):
    """Flower's constructor only stores our strategy; its start() calls our summary() before any
    round: the refusal comes there (a TypeError, before any message or evaluation), naming ours."""
    import flwr.serverapp.strategy as flower
    from test_dropin import fedavg_client, grid_of, initial

    inner = STRATEGIES["fedbuff"]()
    if private:
        inner = AsyncDPFixedClipping(inner, noise_multiplier=1.0, clipping_norm=1.0)
    options = {"clipping_norm": 1.0} if "Fixed" in wrapper else {}
    wrapped = getattr(flower, wrapper)(inner, noise_multiplier=0.1, num_sampled_clients=2, **options)
    # (constructed: Flower's __init__ only stores it)
    evaluated = []
    ours = "AsyncDPAdaptiveClipping" if "Adaptive" in wrapper else "AsyncDPFixedClipping"
    with pytest.raises(TypeError, match=f"{wrapper} is round-based.*fl_rescaled.{ours}\\(strategy"):
        wrapped.start(grid=grid_of(fedavg_client(), taus=(1.0, 2.0)), initial_arrays=initial(), num_rounds=2,
                      evaluate_fn=lambda rnd, arrays: evaluated.append(rnd))
    assert not evaluated  # (refused before Flower's initial evaluation)
    with pytest.raises(NotImplementedError, match="AsyncDPFixedClipping"):  # (a round hook called by hand)
        wrapped.configure_train(1, None, None, None)
    inner.summary()  # (called by anyone else, it logs as before)


@pytest.mark.parametrize("name", ["malenia", "ringleader", "minibatch", "fedavg"])
def test_strategies_that_reuse_stored_updates_are_refused(name):
    with pytest.raises(ValueError, match="FedBuff, FedAsync and the ASGD methods"):
        AsyncDPFixedClipping(STRATEGIES[name](), noise_multiplier=1.0, clipping_norm=1.0)


def test_bad_options_are_refused_in_one_line():
    for kw, why in (({"noise_multiplier": -1.0}, "noise_multiplier"), ({"clipping_norm": 0.0}, "clipping_norm"),
                    ({"delta": 1.0}, "delta"), ({"noise_multiplier": 0.0, "target_epsilon": 1.0}, "needs noise")):
        with pytest.raises(ValueError, match=why):
            AsyncDPFixedClipping(STRATEGIES["rescaled"](), **{"noise_multiplier": 1.0, "clipping_norm": 1.0, **kw})
    with pytest.raises(ValueError, match="--dp-noise-multiplier and --dp-clipping-norm"):
        quad_run(dp_noise_multiplier=1.0)


def test_batched_replicas_are_refused_before_any_job():
    """Batched replicas travel as one vector (no per-replica clip, one noise draw): refused."""
    from test_dropin import fedavg_client, grid_of, initial

    jobs = Jobs()
    s = AsyncDPFixedClipping(STRATEGIES["fedbuff"](lr=1.0, fraction_evaluate=0.0), noise_multiplier=1.0,
                             clipping_norm=0.5)
    with pytest.raises(ValueError, match="cannot run batched replicas.*experiment.run"):
        s.start(grid=grid_of(fedavg_client(), taus=(1.0, 2.0)), initial_arrays=initial(), time_budget=5,
                replicas=[1.0, 1.0, 1.0], observers=[jobs])  # (3 replicas of the 9 floats)
    assert not jobs.sent


# ------------------------------------------------------------------------------------------------ adaptive clipping
def adaptive(strategy: str = "vanilla", **kw) -> AsyncDPAdaptiveClipping:
    inner = STRATEGIES[strategy](**({"lr": 1.0} if strategy == "vanilla" else {"buffer_size": 4,
                                                                             "staleness_exponent": 0.0}))
    return AsyncDPAdaptiveClipping(inner, **{"noise_multiplier": 0.5, "seed": 5, **kw})


@pytest.mark.parametrize("strategy,quantile", [("vanilla", 0.5), ("vanilla", 0.8), ("fedbuff", 0.5)])
def test_the_adaptive_clipping_norm_moves_to_the_target_quantile_of_the_norms(strategy, quantile):
    """Updates whose norms are log-uniform on [1, 100]: the q-quantile is 100^q. From C_0 = 0.01
    (far below) the norm climbs to it and its geometric mean over the last 3,000 updates is within a
    factor 1.25 of it (the bits' noise σ_b = 0.6 per release, η = 0.05; seeds 5 to 7 land within 9%),
    whether one update (Vanilla) or a buffer of 4 (FedBuff) is released."""
    s = adaptive(strategy, initial_clipping_norm=0.01, target_clipped_quantile=quantile, clip_norm_lr=0.05)
    run = ScriptedRun(n=4, x=np.zeros(10))
    run.start(s)
    rng = np.random.default_rng(1)
    late = []
    for k in range(6000):
        direction = rng.normal(size=10)
        run.deliver(s, k % 4, direction / np.linalg.norm(direction) * 10 ** rng.uniform(0, 2))
        late += [run.strategy_state.adaptive.clip] if k >= 3000 else []
    target = 100 ** quantile
    assert 1 / 1.25 < np.exp(np.mean(np.log(late))) / target < 1.25
    assert max(np.linalg.norm(step.update - 0) for step in run.steps[:5]) < 1  # (clipped to the small C_0 first)


def test_the_adaptive_noise_and_accounting_follow_the_derivation():
    """The update's noise has std z_Δ C with z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) (6-sd bounds on 400,000
    draws: a false failure about 2e-9), the pair (update, count) costs what one Gaussian of noise
    multiplier z does (by the library), and the accountant charges z."""
    z, sb, c, d = 0.8, 1.5, 2.0, 400_000
    zd = (z ** -2 - (2 * sb) ** -2) ** -0.5
    assert update_noise_multiplier(z, sb) == pytest.approx(zd) and zd > z
    s = adaptive(noise_multiplier=z, initial_clipping_norm=c, clipped_count_stddev=sb)
    run = ScriptedRun(n=1, x=np.zeros(d))
    run.start(s)
    run.deliver(s, 0, np.zeros(d))
    (step,) = run.steps
    assert abs(step.update.std() / (zd * c) - 1) < 6 / math.sqrt(2 * d)
    assert run.strategy_state.adaptive.clip != c and not run.strategy_state.adaptive.bits  # (moved, bits spent)
    pair, one = dpa.rdp.RdpAccountant(), dpa.rdp.RdpAccountant()
    pair.compose(dpa.ComposedDpEvent([dpa.GaussianDpEvent(zd), dpa.GaussianDpEvent(2 * sb)]), 50)
    one.compose(dpa.GaussianDpEvent(z), 50)
    assert pair.get_epsilon(1e-5) == pytest.approx(one.get_epsilon(1e-5), rel=1e-6)
    for _ in range(49):
        run.deliver(s, 0, np.zeros(d))
    assert s.report(run.strategy_state)["epsilon"][0] == pytest.approx(one.get_epsilon(1e-5), rel=1e-6)
    with pytest.raises(ValueError, match="2 σ_b > z"):
        adaptive(noise_multiplier=1.0, clipped_count_stddev=0.5)


def test_adaptive_clipping_bad_options_and_state_are_refused():
    for kw, why in (({"target_clipped_quantile": 1.0}, "quantile"), ({"clip_norm_lr": 0.0}, "clip_norm_lr"),
                    ({"initial_clipping_norm": -1.0}, "clipping_norm"), ({"clipped_count_stddev": -1.0}, "stddev")):
        with pytest.raises(ValueError, match=why):
            adaptive(**kw)
    arrays: dict = {}
    tree = encode(AdaptiveClipping(0.5, [1, 0]), arrays)
    assert decode(AdaptiveClipping, tree, arrays) == AdaptiveClipping(0.5, [1, 0])
    for field, value in (("clip", -1.0), ("clip", float("inf")), ("bits", [2])):
        with pytest.raises(StateError, match="privacy"):
            decode(AdaptiveClipping, {**tree, field: value}, arrays)


# ------------------------------------------------------------------------------------------------ checkpoints
def test_the_accountants_state_is_checked_when_restored():
    state = PrivacyState.fresh(3, 0)
    arrays: dict = {}
    tree = encode(state, arrays)
    decode(PrivacyState, tree, arrays)
    for field, value in (("counts", [{"1": 1}, {}, {}]), ("counts", [{"0": 1}, {}, {}]), ("pending", [5])):
        bad = json.loads(json.dumps(tree))
        bad[field] = value
        with pytest.raises(StateError, match="privacy"):
            decode(PrivacyState, bad, arrays)


@pytest.mark.slow
@pytest.mark.parametrize("population", [[], ["--taus", "1,1,2,2,3,3", "--concurrency", "3", "--dp-target-epsilon", "10"],
                                        ["--dp-target-quantile", "0.5", "--lr", "0.01"]],
                         ids=["C=N", "C<N", "adaptive"])  # (C < N: budgets end it at t ≈ 111)
def test_a_private_run_killed_and_resumed_reports_the_same_epsilon_and_model(tmp_path, population):
    """C = N and C = 3 of N = 6 (the selection leaving out the clients over budget): killed mid-run
    and resumed, the run reports the ε, exclusions and model of the uninterrupted one."""
    from test_checkpoint import cli, final_model, killed_then_resumed

    args = ["--task", "quadratic", "--strategy", "fedbuff", "--taus", "1,2,3", "--quad-dim", "50", "--delays",
            "exponential", "--budget", "200", "--eval-every", "20", "--seed", "3", "--dp-noise-multiplier", "3",
            "--dp-clipping-norm", "0.5", "--dp-target-epsilon", "20", *population]  # (budgets end it at t ≈ 117)
    ref = cli(*args, "--out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    res = killed_then_resumed(args, tmp_path / "killed", 10, 61.0, 200)
    assert res.returncode == 0, res.stderr
    a, b = json.loads(ref.stdout.splitlines()[-1]), json.loads(res.stdout.splitlines()[-1])
    assert a["dp"] == b["dp"] and a["dp"]["releases"] > 0 and a["dp"]["excluded"]
    np.testing.assert_array_equal(final_model(tmp_path / "killed"), final_model(tmp_path / "ref"))


@pytest.mark.parametrize("wrapper,clip", [(AsyncDPFixedClipping, {"clipping_norm": 0.5}),
                                          (AsyncDPAdaptiveClipping, {"initial_clipping_norm": 0.5})])
def test_the_wrapper_is_a_one_line_switch_in_a_flower_app_and_its_result_holds_the_epsilons(wrapper, clip):
    """``AsyncDPFixedClipping(FedBuff(), ...).start(...)`` (or the adaptive one) with an unchanged
    FedAvg ClientApp: the Result carries the ``"dp"`` object and each evaluation point's ε max and mean."""
    from test_dropin import fedavg_client, grid_of, initial

    s = wrapper(STRATEGIES["fedbuff"](buffer_size=2, fraction_evaluate=0.0), noise_multiplier=1.0, seed=0, **clip)
    result = s.start(grid=grid_of(fedavg_client(), taus=(1.0, 2.0, 3.0)), initial_arrays=initial(),
                     train_config={"lr": 0.05}, time_budget=20)
    dp = result.privacy
    assert dp["releases"] == result.books["updates"] > 0
    accepted = result.books["replies-accepted"]  # (all released, but for at most K − 1 left in the buffer)
    assert accepted - 1 <= sum(dp["contributions"]) <= accepted
    last = result.progress[max(result.progress)]
    assert dp["max_epsilon"] > 0 and last["dp-max-epsilon"] == pytest.approx(dp["max_epsilon"])
