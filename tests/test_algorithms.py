"""Every strategy's completion logic alone: a scripted run (``tests/scripted.py``) hands it completions
one by one and records what it does (steps, jobs, resends, cancellations). No Grid, clock or manager:
a strategy bug fails here, a manager bug does not."""

from __future__ import annotations

import numpy as np
import pytest

from fl_rescaled.strategies import STRATEGIES
from scripted import ScriptedRun

RescaledASGD, VanillaASGD, DelayAdaptiveASGD = STRATEGIES["rescaled"], STRATEGIES["vanilla"], STRATEGIES["delay-adaptive"]
MaleniaSGD, RingleaderASGD, MinibatchSGD = STRATEGIES["malenia"], STRATEGIES["ringleader"], STRATEGIES["minibatch"]
ConcurrentASGD, FedAsync, FedBuff = STRATEGIES["concurrent"], STRATEGIES["fedasync"], STRATEGIES["fedbuff"]

TAUS = [1.0, 2.0, 4.0]


def started(strategy, n=3, x=(0.0, 0.0), **kw):
    run = ScriptedRun(n=n, x=np.array(x, dtype=float), periods=kw.pop("taus", TAUS), **kw)
    run.start(strategy)
    return run


# ---------------------------------------------------------------------------------------------- the ASGD family
def test_rescaled_steps_each_worker_in_proportion_to_its_tau_and_restarts_it():
    s = RescaledASGD(lr=0.6)
    run = started(s)
    assert run.sent == [0, 1, 2]  # one job each at the start
    g = np.array([1.0, -2.0])
    for worker in (2, 0, 1):
        run.deliver(s, worker, g)
    # γ_i = α · (1/n) · τ_i / τ_max
    assert [(st.worker, st.stepsize) for st in run.steps] == [(2, 0.6 / 3 * 4 / 4), (0, 0.6 / 3 * 1 / 4),
                                                             (1, 0.6 / 3 * 2 / 4)]
    assert run.sent == [0, 1, 2, 2, 0, 1]  # each worker gets the new model back at once
    np.testing.assert_allclose(run.x, -(0.2 + 0.05 + 0.1) * g)


def test_rescaled_with_target_weights_scales_by_them():
    s = RescaledASGD(lr=1.0, weights=[0.5, 0.25, 0.25])
    run = started(s)
    run.deliver(s, 1, [1.0, 0.0])
    assert run.steps[0].stepsize == pytest.approx(0.25 * 2 / 4)


def test_vanilla_gives_every_worker_the_same_step():
    s = VanillaASGD(lr=0.7)
    run = started(s)
    for worker in (0, 2, 1):
        run.deliver(s, worker, [1.0, 1.0])
    tau_h = 3 / (1 + 1 / 2 + 1 / 4)
    assert [st.stepsize for st in run.steps] == pytest.approx([0.7 * tau_h / (3 * 4)] * 3)


@pytest.mark.parametrize("rule,expected", [("inverse", lambda g, d, n: g / (1 + d)),
                                           ("authors", lambda g, d, n: g * n / max(n, d))])
def test_delay_adaptive_shrinks_the_step_with_the_delay(rule, expected):
    s = DelayAdaptiveASGD(lr=1.0, rule=rule)
    run = started(s, n=3)
    gamma = 1.0 * (3 / (1 + 1 / 2 + 1 / 4)) / (3 * 4)
    for _ in range(5):  # worker 0 delivers five times: its jobs carry the newest model (delay 0)
        run.deliver(s, 0, [1.0, 0.0])
    run.deliver(s, 1, [1.0, 0.0])  # worker 1's job carries version 0: delay 5
    assert run.steps[0].stepsize == pytest.approx(gamma)
    assert run.steps[-1].stepsize == pytest.approx(expected(gamma, 5, 3))


def test_asgd_replaces_a_rejected_job_only_for_a_worker_still_on_its_node():
    s = RescaledASGD()
    run = started(s)
    run.fail(s, 1)
    assert run.sent[-1] == 1 and not run.steps  # a fresh job, the model untouched
    run.online.discard(2)
    run.fail(s, 2, "error-code-5")  # its node is gone: it gets a job when it comes back
    assert run.sent == [0, 1, 2, 1]


def test_jobs_per_node_keeps_that_many_jobs_in_flight_per_worker():
    s = RescaledASGD(jobs_per_node=2)
    run = started(s)
    assert run.sent == [0, 0, 1, 1, 2, 2]


# ---------------------------------------------------------------------------------------------- Malenia SGD
def test_malenia_closes_a_round_once_every_worker_delivered_with_the_average_of_means():
    s = MaleniaSGD(lr=0.5)
    run = started(s, x=(0.0,))
    run.deliver(s, 0, [1.0])
    run.deliver(s, 0, [3.0])  # worker 0 keeps computing on x^0: two gradients, mean 2
    run.deliver(s, 1, [4.0])
    assert run.resent == [0, 0, 1] and not run.steps
    assert run.strategy_state.B.tolist() == [2, 1, 0]
    last = run.oldest(2).job_id
    others = [j.job_id for j in run.inflight if j.job_id != last]  # workers 0 and 1 are computing again
    run.deliver(s, 2, [6.0])  # the last worker: the round closes
    (step,) = run.steps
    assert step.worker == 2 and step.stepsize == 0.5
    np.testing.assert_allclose(step.update, [(2.0 + 4.0 + 6.0) / 3])  # equal weights over the workers
    assert run.cancelled == others  # the jobs still running are cancelled
    assert run.sent[-3:] == [0, 1, 2] and run.strategy_state.B.tolist() == [0, 0, 0] and run.strategy_state.round_version == 1


def test_malenia_discards_a_late_job_of_an_earlier_round():
    s = MaleniaSGD()
    run = started(s, x=(0.0,))
    for w in range(3):
        run.deliver(s, w, [1.0])  # round 0 closes at worker 2
    late = run._job(0, 0)  # a job of round 0 that was not stopped (wall clock)
    run.inflight.insert(0, run.inflight.pop())
    run.deliver(s, 0, [100.0])
    assert run.discarded == [late.job_id] and len(run.steps) == 1 and run.strategy_state.B.tolist() == [0, 0, 0]


def test_malenia_s_rule_closes_at_the_first_arrival_past_the_threshold():
    s = MaleniaSGD(S=6.0)
    run = started(s, x=(0.0,))
    closed_at = None
    for i, w in enumerate((0, 1, 2, 0, 1, 2, 0)):
        run.deliver(s, w, [1.0])
        if run.steps and closed_at is None:
            closed_at = i
    # The harmonic mean of the counts after each arrival: (1,0,0), (1,1,0): a worker has none;
    # (1,1,1) 1.0; (2,1,1) 1.2; (2,2,1) 1.5; (2,2,2) 2.0, not above S/n = 2; (3,2,2) 2.25: the
    # seventh arrival (index 6) closes the round.
    assert closed_at == 6


# ---------------------------------------------------------------------------------------------- Ringleader ASGD
def test_ringleader_gathers_then_makes_n_updates_one_per_worker():
    s = RingleaderASGD(lr=0.3)
    run = started(s, x=(0.0,))
    run.deliver(s, 0, [1.0])
    run.deliver(s, 0, [3.0])  # phase 1: worker 0 keeps its model
    run.deliver(s, 1, [2.0])
    assert not run.steps and run.resent == [0, 0, 1]
    run.deliver(s, 2, [5.0])  # every worker in the table: the first update, by worker 2
    assert [st.worker for st in run.steps] == [2] and run.strategy_state.phase == 2 and run.strategy_state.P == {0, 1}
    np.testing.assert_allclose(run.steps[0].update, [(2.0 + 2.0 + 5.0) / 3])
    assert run.steps[0].stepsize == pytest.approx(0.3 / 3)
    run.deliver(s, 2, [7.0])  # already served this round: into the next table, keeps its model
    assert run.strategy_state.b_next.tolist() == [0, 0, 1] and len(run.steps) == 1
    run.deliver(s, 1, [4.0])
    run.deliver(s, 0, [6.0])  # the last of P: the round ends, the next table becomes the table
    assert [st.worker for st in run.steps] == [2, 1, 0]
    assert run.strategy_state.round_triggers == [[2, 1, 0]] and run.strategy_state.phase == 1
    assert run.strategy_state.b.tolist() == [0, 0, 1] and run.strategy_state.b_next.tolist() == [0, 0, 0]


def test_ringleader_restart_on_current_sends_the_current_model():
    s = RingleaderASGD(restart_on_current=True)
    run = started(s, x=(0.0,))
    run.deliver(s, 0, [1.0])
    assert run.resent == [] and run.sent[-1] == 0


# ---------------------------------------------------------------------------------------------- Minibatch SGD
def test_minibatch_waits_for_every_worker_then_steps_with_the_mean():
    s = MinibatchSGD(lr=2.0)
    run = started(s, x=(0.0,))
    run.deliver(s, 1, [3.0])
    run.deliver(s, 0, [1.0])
    assert not run.steps and run.sent == [0, 1, 2]  # the fast workers idle
    run.deliver(s, 2, [5.0])
    (step,) = run.steps
    np.testing.assert_allclose(step.update, [3.0])  # (3 + 1 + 5) / 3
    assert step.stepsize == 2.0 and run.sent == [0, 1, 2, 0, 1, 2]


# ---------------------------------------------------------------------------------------------- Concurrent ASGD
def test_concurrent_sends_each_new_model_to_a_seeded_random_worker():
    a, b = ConcurrentASGD(seed=4), ConcurrentASGD(seed=4)
    runs = [started(a, n=5, taus=[1.0] * 5), started(b, n=5, taus=[1.0] * 5)]
    for s, run in zip((a, b), runs):
        for w in range(5):
            run.deliver(s, w, [1.0, 1.0])
    assert runs[0].sent == runs[1].sent and runs[0].sent[:5] == [0, 1, 2, 3, 4]
    drawn = runs[0].sent[5:]
    assert len(set(drawn)) > 1  # not the worker that delivered: a random one
    assert [st.stepsize for st in runs[0].steps] == pytest.approx([1.0 / 5] * 5)  # Vanilla's step, τ all 1


def test_concurrent_starts_tau_c_workers():
    s = ConcurrentASGD(concurrency=2, seed=1)
    run = started(s, n=5, taus=[1.0] * 5, concurrency=2)
    assert len(run.sent) == 2 and len(set(run.sent)) == 2


# ---------------------------------------------------------------------------------------------- FedAsync, FedBuff
def test_fedasync_mixes_the_returned_model_with_a_staleness_discount():
    s = FedAsync(mixing=0.5, staleness="polynomial", a=1.0)
    run = started(s, x=(2.0, 0.0))
    y = np.array([0.0, 4.0])
    run.deliver(s, 0, run.x - y)  # a fresh model (delay 0): x ← (1 − 0.5) x + 0.5 y
    np.testing.assert_allclose(run.x, [1.0, 2.0])
    x_tau = run.models[0]  # worker 1's job carries version 0: delay 1, α_t = 0.5 / 2
    run.deliver(s, 1, x_tau - y)
    np.testing.assert_allclose(run.x, 0.75 * np.array([1.0, 2.0]) + 0.25 * y)


def test_fedbuff_buffers_k_updates_then_steps_with_their_mean():
    s = FedBuff(buffer_size=2, server_lr=3.0, staleness_exponent=0.0)
    run = started(s, x=(0.0,))
    run.deliver(s, 0, [2.0])
    assert not run.steps and run.strategy_state.count == 1 and s.stored_vectors(run.strategy_state) == 1
    run.deliver(s, 1, [4.0])
    (step,) = run.steps
    np.testing.assert_allclose(step.update * step.stepsize, [3.0 * (2.0 + 4.0) / 2])
    assert run.strategy_state.count == 0 and s.stored_vectors(run.strategy_state) == 0 and run.sent[-2:] == [0, 1]


def test_fedbuff_discounts_stale_updates():
    s = FedBuff(buffer_size=1, staleness_exponent=1.0)
    run = started(s, x=(0.0,))
    run.deliver(s, 0, [1.0])  # delay 0: weight 1
    run.deliver(s, 1, [1.0])  # delay 1: weight 1/2
    np.testing.assert_allclose([st.update[0] * st.stepsize for st in run.steps], [1.0, 0.5])


# ---------------------------------------------------------------------------------------------- every strategy
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_has_a_declared_state_before_and_after_a_start(name):
    s = STRATEGIES[name]()
    assert s.stored_vectors(s.State()) == 0  # a fresh state (Ringleader raised here before its state was declared)
    run = started(s)
    assert isinstance(run.strategy_state, s.State) and len(run.sent) >= 1
