"""Lying clients inside the outlier guard, under the default bounds: contained, named, set aside.

The scenario is ``tests/hostile.py``'s (four nodes of noisy quadratics, 400 server updates): one
node, or a quarter of twelve, answers every job with a lie its norm does not give away to the 300×
guard (``hostile.LIES``: the sign flipped ×1, ×10, ×100, the honest update ×250, a constant
direction, a pull toward x = 10, a slow drift). Under the default bounds (the guard, then the median
clip at ``CLIP_FACTOR``, the suspicion rule of ``fl_rescaled.manager.reputation``) every strategy
either ends within 0.3 of the honest run's model, or within 0.05 of the run in which the liars are
simply absent, or stops with ``RunFailed`` naming them (the issue's criterion). Before (the guard
alone, main cc59dfd) a ×10 flip drove Rescaled, FedAsync, FedBuff and Vanilla to 1e30 and beyond,
status completed, and 49 of the 84 cases of one liar in the middle failed the criterion.

With the bounds off, the same lie ruins the run, and the divergence check stops it naming the liar
and handing back the best model (``fl_rescaled.divergence``).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord

import hostile
from fl_rescaled import InProcessGrid, RunFailed
from fl_rescaled.divergence import FACTOR, POINTS, Divergence, DivergenceState, loss_of
from fl_rescaled.strategies import STRATEGIES
from conftest import run_of, start_run

CASES = hostile.cases()


@functools.lru_cache(maxsize=None)
def reference(strategy: str, reply: str, n: int = hostile.N, absent: tuple[int, ...] = ()) -> np.ndarray:
    x, books = hostile.run(strategy, reply, hostile.HostileGrid(n=n, absent=absent))
    assert x is not None, books.get("failed")
    return x


def assert_contained(strategy: str, reply: str, mode: str, liars: tuple[int, ...], n: int = hostile.N) -> dict:
    """The issue's criterion for one run; returns its books."""
    x, books = hostile.run(strategy, reply, hostile.HostileGrid(mode, hostile=liars, n=n))
    if x is None:  # a stop is fine when it names a liar
        assert any(f"partition {i}" in books["failed"] for i in liars), books["failed"]
        return books
    near_honest = hostile.distance(x, reference(strategy, reply, n)) < 0.3
    near_absent = hostile.distance(x, reference(strategy, reply, n, liars)) < 0.05
    assert near_honest or near_absent, (mode, hostile.distance(x, reference(strategy, reply, n)),
                                        hostile.distance(x, reference(strategy, reply, n, liars)))
    assert books["balanced"] == 1
    return books


@pytest.mark.parametrize("liar", [hostile.HOSTILE_NODE, 0, 3], ids=["middle", "fastest", "slowest"])
@pytest.mark.parametrize("strategy,reply", CASES)
def test_one_lying_client_of_four_is_contained(strategy, reply, liar):
    for mode in hostile.LIES:
        assert_contained(strategy, reply, mode, (liar,))


@pytest.mark.parametrize("liar", [hostile.HOSTILE_NODE, 0], ids=["middle", "fastest"])
@pytest.mark.parametrize("strategy,reply", CASES)
def test_lies_that_try_to_stay_under_the_suspicion_rule_are_contained(strategy, reply, liar):
    """Honest for 30 jobs then flipping (set aside later), flipping every other job (its moving ratio
    stays low: never set aside, each lie clipped), a flip of 1.4, under the clip (outweighed), × 250
    every third job."""
    for mode in hostile.SLY:
        assert_contained(strategy, reply, mode, (liar,))


# Delay-Adaptive ASGD is left out: its delay-discounted steps make 400 updates too few for twelve
# nodes (its honest run ends 0.1 from the run without the liars), and it weighs the fast clients
# most, so three fast liars outweigh it (documented in docs/reliability.md).
@pytest.mark.parametrize("strategy,reply", [c for c in CASES if c[0] != "delay-adaptive"])
def test_a_quarter_of_sybils_is_contained(strategy, reply):
    for mode in hostile.LIES:
        assert_contained(strategy, reply, mode, (0, 5, 10), n=12)


@pytest.mark.parametrize("strategy,reply", [("rescaled", "gradient"), ("rescaled", "model"), ("fedasync", "model"),
                                            ("fedbuff", "model"), ("malenia", "gradient")])
@pytest.mark.parametrize("mode", ["x250", "const", "target"])
def test_a_liar_far_above_the_others_is_named_and_set_aside(strategy, reply, mode, caplog):
    """Its updates stay many times the others' median: clipped each time, then set aside for good (or
    rejected three times in a row by the guard, once the honest norms have shrunk), after which the
    run is the run without it. (A ×10 flip sits at 6 to 9 times the others' median, depending on the
    method: set aside by Rescaled ASGD and FedAsync, only clipped by FedBuff; contained either way.)"""
    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    books = assert_contained(strategy, reply, mode, (hostile.HOSTILE_NODE,))
    lines = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(("partition 2 set aside: its updates were",  # (clipped)
                                                    "partition 2 set aside: its last 3 jobs failed")), lines
    sent = books["sent-per-worker"]
    assert sent[hostile.HOSTILE_NODE] < min(sent) + 60 < max(sent), sent  # (no job after it)


def test_the_honest_clients_are_not_set_aside(caplog):
    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    for strategy, reply in CASES:
        reference.cache_clear()
        reference(strategy, reply)
        reference(strategy, reply, 12)
    assert not [r for r in caplog.records if "set aside" in r.getMessage()]


# ------------------------------------------------------------------------ a model that diverges
def quadratic_loss(step: int, arrays: ArrayRecord) -> MetricRecord:
    """The central evaluation of the hostile scenario: the mean of the four clients' f_i."""
    del step
    x = arrays["w"].numpy().astype(np.float64)
    b = hostile.B + hostile.offsets(hostile.N)
    return MetricRecord({"loss": float(np.mean(0.5 * np.sum((x - b) ** 2, axis=1)))})


def start_evaluated(strategy: str, reply: str, grid, **options):
    s = STRATEGIES[strategy](reply=reply, fraction_evaluate=0.0, **options)
    return start_run(s, grid, ArrayRecord({"w": Array(np.zeros(hostile.DIM, np.float32))}), num_updates=hostile.UPDATES,
                   time_budget=20 * hostile.UPDATES * max(hostile.TAUS), eval_every=10.0,
                   clock=hostile.VirtualClock(hostile.DelayModel(hostile.TAUS)), train_config={"reply": reply},
                   partition_query=True, evaluate_fn=quadratic_loss)


@pytest.mark.parametrize("strategy,reply", [("rescaled", "gradient"), ("fedasync", "model"), ("fedbuff", "model")])
def test_with_the_bounds_off_a_diverging_model_stops_the_run_naming_the_liar(strategy, reply):
    """The guard's 300 × and the clip off: a ×10 flip drives the model away; the loss passes 10 × its
    start at three points in a row and the run stops, naming partition 2 first, with the best model
    (its loss no more than the start's) in ``RunFailed.result``."""
    with pytest.raises(RunFailed) as info:
        start_evaluated(strategy, reply, hostile.HostileGrid("flip10"), clip_factor=None)
    msg = str(info.value)
    assert msg.startswith("the model diverged: its server loss was above 10 × its initial") and "\n" not in msg, msg
    assert msg.split("largest: ")[1].startswith("partition 2 "), msg
    best = info.value.result
    assert best is not None and info.value.books["updates"] < hostile.UPDATES
    evals = best.evaluate_metrics_serverapp
    first, lowest = evals[0]["loss"], min(m["loss"] for m in evals.values())
    assert float(quadratic_loss(0, best.arrays)["loss"]) == pytest.approx(lowest) and lowest <= first


def test_under_the_defaults_the_same_liar_completes():
    result = start_evaluated("rescaled", "gradient", hostile.HostileGrid("flip10"))
    assert result.books["updates"] == hostile.UPDATES
    assert hostile.distance(result.arrays["w"].numpy().astype(np.float64), reference("rescaled", "gradient")) < 0.3


def test_divergence_rule():
    rule, state = Divergence(), DivergenceState()
    model = lambda: (np.array([7.0]), {})  # noqa: E731
    assert rule.point(state, 0, {"loss": 2.0, "accuracy": 0.1}, None, model) is None
    assert state.source == "server loss" and state.initial == 2.0 and state.best_step == 0
    for step in range(1, POINTS):
        assert rule.point(state, step, {"loss": FACTOR * 2.0 + 1}, None, model) is None
    assert rule.point(state, POINTS, {"loss": 5.0}, None, model) is None and state.above == 0  # (not in a row)
    for step in range(POINTS + 1, 2 * POINTS):
        assert rule.point(state, step, {"loss": 30.0}, None, model) is None
    why = rule.point(state, 2 * POINTS, {"loss": 30.0}, None, model)
    assert why is not None and f"at {POINTS} evaluation points in a row" in why
    assert rule.point(DivergenceState(), 0, None, {"eval_loss": float("nan")}, model) == (
        "its federated eval_loss is nan at evaluation point 0")
    fresh = DivergenceState()
    assert rule.point(fresh, 0, {"loss": 0.0}, None, model) is None  # (no positive start: only non-finite counts)
    assert all(rule.point(fresh, k, {"loss": 1e30}, None, model) is None for k in range(1, 10))
    assert loss_of({"test_loss": 1.0, "acc": 2}) == ("test_loss", 1.0) and loss_of({"loss": [1, 2]}) is None
    with pytest.raises(ValueError):
        Divergence(factor=1.0)


@pytest.mark.parametrize("strategy,reply", [("fedasync", "model"), ("fedbuff", "model"), ("vanilla", "gradient")])
def test_an_honest_client_that_is_much_faster_than_the_others_is_not_set_aside(strategy, reply, caplog):
    """40 honest nodes, τ lognormal (σ = 1.2, seed 0: the fastest at 0.061, 16 times the median
    speed). Under the methods that count every reply alike its replies weigh many times the others'
    (a weighted ratio above 8), but its norms are the others': the suspicion rule needs both, so no
    client is set aside. (With the weighted ratio alone the population study lost its fastest honest
    clients under FedBuff and FedAsync.)"""
    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    n = 40
    taus = list(np.round(np.exp(np.random.default_rng(0).normal(0.0, 1.2, n)), 3))
    s = STRATEGIES[strategy](reply=reply, fraction_evaluate=0.0)
    grid = InProcessGrid(hostile.app, n, node_configs=[{"client": i % hostile.N} for i in range(n)])
    start_run(s, grid, ArrayRecord({"w": Array(np.zeros(hostile.DIM, np.float32))}), time_budget=200.0,
            clock=hostile.VirtualClock(hostile.DelayModel(taus)), train_config={"reply": reply}, partition_query=True)
    assert not [r for r in caplog.records if "set aside" in r.getMessage()]
    state = run_of(s).manager.bound_state[1]
    fastest = int(np.argmin(taus))
    assert np.exp(state.log_ratio[fastest]) > 8 and np.exp(state.log_plain[fastest]) < 2
