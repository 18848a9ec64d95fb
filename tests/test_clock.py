"""Virtual clock, delay models and per-worker update counts."""

import numpy as np
import pytest
from conftest import quad

from fl_rescaled.clock import DelayModel, tau_stats


@pytest.mark.parametrize("taus", [[1, 2], [1, 1, 2, 2, 4, 4, 8, 8, 16, 16], [3, 5, 7]])
def test_fixed_update_counts_equal_budget_over_tau(taus):
    budget = 480.0
    out = quad(strategy="rescaled", taus=taus, quad_a=[1.0] * len(taus), quad_b=list(range(len(taus))),
               lr=0.01, budget=budget, eval_every=budget)
    for tau, count in zip(taus, out["updates_per_worker"]):
        assert abs(count - budget / tau) <= 1
    assert out["num_updates"] == sum(out["updates_per_worker"])


def test_exponential_delays_reproducible_and_unbiased():
    taus = [1.0, 4.0, 16.0]
    a, b = DelayModel(taus, "exponential", seed=7), DelayModel(taus, "exponential", seed=7)
    draws_a = [[a.sample(i) for _ in range(20000)] for i in range(3)]
    draws_b = [[b.sample(i) for _ in range(20000)] for i in range(3)]
    assert draws_a == draws_b
    c = DelayModel(taus, "exponential", seed=8)
    assert [c.sample(0) for _ in range(5)] != draws_a[0][:5]
    for tau, d in zip(taus, draws_a):
        assert abs(np.mean(d) / tau - 1) < 0.05
        assert min(d) > 0


def test_exponential_runs_reproducible_by_seed():
    kw = dict(strategy="rescaled", taus=[1, 2, 4], quad_a=[1, 1, 1], quad_b=[0, 1, 2], lr=0.05,
              budget=300, delays="exponential", noise=0.5)
    r1, r2, r3 = quad(seed=3, **kw), quad(seed=3, **kw), quad(seed=4, **kw)
    assert r1["final_params"] == r2["final_params"]
    assert r1["updates_per_worker"] == r2["updates_per_worker"]
    assert r1["final_params"] != r3["final_params"]


def test_worker_draws_independent_of_interleaving():
    # Worker 1's sequence does not depend on how often worker 0 was sampled in between.
    m1, m2 = DelayModel([1, 2], "exponential", 5), DelayModel([1, 2], "exponential", 5)
    seq1 = [m1.sample(1) for _ in range(10)]
    seq2 = []
    for _ in range(10):
        m2.sample(0)
        seq2.append(m2.sample(1))
    assert seq1 == seq2


def test_ties_processed_in_worker_order():
    from fl_rescaled.clients.client_app import app
    from flwr.app import Array, ArrayRecord

    from fl_rescaled import InProcessGrid, VanillaASGD, VirtualClock
    from fl_rescaled.manager import OnEvent
    from fl_rescaled.tasks import task_spec

    order = []
    s = VanillaASGD(lr=0.01)

    cfg = {"task": "quadratic", "num-partitions": 3, "quad-a": [1.0] * 3, "quad-b": [0.0, 1.0, 2.0]}
    s.start(InProcessGrid(app, 3), ArrayRecord({"model": Array(np.zeros(1))}), time_budget=8,
            train_config={"task": task_spec(cfg)}, clock=VirtualClock(DelayModel([2, 1, 2])), partition_query=True,
            observers=[OnEvent(lambda comp, x: order.append((comp.time, comp.worker)))])
    assert order == sorted(order)
    assert order[:3] == [(1.0, 1), (2.0, 0), (2.0, 1)]
    assert (2.0, 2) in order and order.index((2.0, 2)) == 3


def test_tau_stats():
    st = tau_stats([1, 2, 4, 4])
    assert st["tau_max"] == 4 and st["tau_A"] == 2.75
    assert st["tau_H"] == pytest.approx(4 / (1 + 0.5 + 0.25 + 0.25))
    with pytest.raises(ValueError):
        tau_stats([1, 0])
    with pytest.raises(ValueError):
        DelayModel([1, 2], "gamma")
