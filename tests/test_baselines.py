"""The comparison methods on the shared engine: fixed points, waste, idleness, memory, rounds."""

import numpy as np
import pytest
from conftest import quad, run_of, start_run

TAUS, A, B = [1, 2, 4], [1.0, 3.0, 2.0], [2.0, -1.0, 5.0]
X_STAR = sum(a * b for a, b in zip(A, B)) / sum(A)  # equal-weight minimiser
SPREAD = max(B) - min(B)


@pytest.mark.parametrize("strategy,lr,budget", [
    ("malenia", 0.05, 3000),
    ("ringleader", 0.05, 3000),
    ("minibatch", 0.05, 3000),
    ("concurrent", 0.01, 8000),
])
def test_unbiased_methods_reach_equal_weight_minimiser(strategy, lr, budget):
    out = quad(strategy=strategy, taus=TAUS, quad_a=A, quad_b=B, lr=lr, budget=budget, quad_x0=-4.0,
               eval_every=budget / 20)
    assert abs(out["final_params"][0] - X_STAR) < 0.02 * SPREAD, out["final_params"]


def test_vanilla_is_not_unbiased_here():
    # Guard that the setting above can tell the difference (Vanilla's fixed point is ∝ 1/τ_i).
    out = quad(strategy="vanilla", taus=TAUS, quad_a=A, quad_b=B, lr=0.05, budget=3000, quad_x0=-4.0)
    assert abs(out["final_params"][0] - X_STAR) > 0.05 * SPREAD  # its fixed point is 1.0, x* = 1.5


def test_malenia_discards_work_only_under_heterogeneous_tau():
    kw = dict(quad_a=A, quad_b=B, lr=0.05, budget=400)
    het = quad(strategy="malenia", taus=[2, 3, 5], **kw)
    expo = quad(strategy="malenia", taus=TAUS, delays="exponential", **kw)
    hom = quad(strategy="malenia", taus=[2, 2, 2], **kw)
    for out in (het, expo):
        assert sum(out["discarded_per_worker"]) > 0 and out["wasted_time"] > 0
    # Equal τ = 2: at t = 2k all three deliver at once (ties in worker order); workers 0 and 1 have
    # just been given another job on the same model when worker 2 closes the round, so those jobs
    # are cancelled before doing any work: 200 rounds, 200 cancelled jobs each, nothing wasted.
    assert hom["discarded_per_worker"] == [200, 200, 0] and hom["wasted_time"] == 0
    # Fixed τ: the slowest worker closes every round and never wastes; with τ = (2, 3, 5) each
    # round lasts 5 and the others lose the partial job they started at 4 (worker 0) and 3 (worker 1).
    assert het["discarded_per_worker"][2] == 0
    rounds = 400 // 5
    assert het["wasted_time"] == pytest.approx(rounds * (1 + 2), rel=0.02)
    # Harmonic τ (every ratio an integer): fast workers finish exactly at the round's end.
    harm = quad(strategy="malenia", taus=TAUS, **kw)
    assert harm["wasted_time"] == 0


def test_memory_columns():
    kw = dict(taus=[1, 2, 4, 8], quad_a=[1.0] * 4, quad_b=[0.0, 1.0, 2.0, 3.0], lr=0.05, budget=300, eval_every=5)
    ring = quad(strategy="ringleader", **kw)
    assert max(h["stored_vectors"] for h in ring["history"]) <= 2 * 4
    assert max(h["stored_vectors"] for h in ring["history"]) > 4  # the next table is really used
    assert sum(ring["discarded_per_worker"]) == 0 and ring["wasted_time"] == 0
    for name in ("rescaled", "vanilla"):
        out = quad(strategy=name, **kw)
        assert all(h["stored_vectors"] == 0 for h in out["history"])
    assert all(h["stored_vectors"] == 4 for h in quad(strategy="malenia", **kw)["history"])


def test_minibatch_idle_share():
    taus = [1, 2, 4, 8]
    out = quad(strategy="minibatch", taus=taus, quad_a=[1.0] * 4, quad_b=[0.0, 1.0, 2.0, 3.0], lr=0.05, budget=800)
    for tau, idle in zip(taus, out["idle_share_per_worker"]):
        assert idle == pytest.approx(1 - tau / max(taus), abs=0.01)
    asgd = quad(strategy="rescaled", taus=taus, quad_a=[1.0] * 4, quad_b=[0.0, 1.0, 2.0, 3.0], lr=0.05, budget=800)
    assert all(s == 0 for s in asgd["idle_share_per_worker"])


def test_ringleader_rounds_have_n_updates_one_per_worker():
    from fl_rescaled.clients.client_app import app
    from flwr.app import Array, ArrayRecord

    from fl_rescaled import DelayModel, InProcessGrid, VirtualClock
    from fl_rescaled.tasks import task_spec
    from fl_rescaled.strategies import RingleaderASGD

    n = 5
    cfg = {"task": "quadratic", "num-partitions": n, "quad-a": [1.0] * n, "quad-b": [float(i) for i in range(n)]}
    s = RingleaderASGD(lr=0.1)
    start_run(s, InProcessGrid(app, n), ArrayRecord({"model": Array(np.zeros(1))}), time_budget=500,
            train_config={"task": task_spec(cfg)}, clock=VirtualClock(DelayModel([1, 2, 3, 5, 8])),
            partition_query=True)
    complete = run_of(s).strategy_state.round_triggers[:-1]
    assert len(complete) > 10
    for rnd in complete:
        assert sorted(rnd) == list(range(n))
    assert run_of(s).version == sum(len(r) for r in run_of(s).strategy_state.round_triggers)


def test_fedbuff_q1_k1_matches_vanilla():
    kw = dict(taus=[1, 2, 3], quad_a=[1.0, 2.0, 0.5], quad_b=[1.0, -1.0, 3.0], lr=0.05, budget=200,
              noise=0.2, quad_dim=3, seed=5)
    van = quad(strategy="vanilla", **kw)
    fb = quad(strategy="fedbuff", options={"buffer_size": 1, "staleness_exponent": 0.0}, local_steps=1, **kw)
    np.testing.assert_allclose(fb["final_params"], van["final_params"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose([h["loss"] for h in fb["history"]], [h["loss"] for h in van["history"]],
                               rtol=1e-9)
    assert fb["cumulative_stepsize"] == pytest.approx(van["cumulative_stepsize"])


def test_fedasync_converges_and_staleness_functions():
    from fl_rescaled.stepsizes import fedasync_staleness

    def s(kind: str, delay: int, a: float = 0.5, b: int = 4) -> float:  # s(δ): the weight of a step of 1
        return fedasync_staleness(kind, a, b)(1.0, delay, 0)

    assert s("constant", 7) == 1.0
    assert s("polynomial", 3, a=0.5) == pytest.approx(0.5)
    assert s("hinge", 4, a=1.0, b=4) == 1.0
    assert s("hinge", 6, a=1.0, b=4) == pytest.approx(1 / 3)
    out = quad(strategy="fedasync", taus=[1, 1], quad_a=[1.0, 1.0], quad_b=[1.0, 3.0], lr=0.05, budget=2000,
               quad_x0=-5.0)
    assert abs(out["final_params"][0] - 2.0) < 0.05


def test_all_strategies_table():
    from conftest import run_sim

    r = run_sim("--strategy", "all", "--task", "quadratic", "--taus", "1,2,4", "--quad-a", "1,3,2", "--quad-b",
                "2,-1,5", "--lr", "0.05", "--budget", "200")
    assert r.returncode == 0, r.stderr
    for name in ("rescaled", "vanilla", "delay-adaptive", "malenia", "ringleader", "minibatch", "concurrent",
                 "fedasync", "fedbuff"):
        assert any(line.startswith(name) for line in r.stdout.splitlines()), name
    assert "idle" in r.stdout and "vectors" in r.stdout and "discarded" in r.stdout
    # The vectors column counts what the server holds, the model included: Rescaled ASGD the model
    # only, Malenia SGD one gradient accumulator per client besides it (docs/methods.md).
    out = r.stdout.splitlines()
    top = next(i for i, line in enumerate(out) if line.startswith("strategy"))
    assert out[top].split()[-3:] == ["vectors", "wall", "s"]
    rows = {line.split()[0]: line.split() for line in out[top + 2:top + 11]}
    assert rows["rescaled"][-2] == "1" and rows["malenia"][-2] == "4"  # (the last column: wall s)
