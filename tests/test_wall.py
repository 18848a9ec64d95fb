"""Wall-clock mode: arrival order, online τ estimates, nodes that leave and come back.

These runs use the in-process Grid in threaded mode (one thread per node, replies pulled when
ready) with emulated compute times: the clients sleep τ_i × time-unit seconds per job.
"""

import threading
import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fl_rescaled.clients.client_app import app
from fl_rescaled import InProcessGrid, MaleniaSGD, MinibatchSGD, RescaledASGD, RingleaderASGD, WallClock
from fl_rescaled.experiment import RunSpec, run
from fl_rescaled.manager import ManagerSettings, OnEvent
from fl_rescaled.tasks import task_spec

B = [0.0, 3.0, 6.0]


def wall(strategy, **kw):
    spec = dict(task="quadratic", strategy=strategy, taus=[1, 2, 4], quad_a=[1, 1, 1], quad_b=B, lr=0.05,
                budget=200, clock="wall", time_unit=0.02, emulate="fixed", eval_every=50)
    spec.update(kw)
    return run(RunSpec(**spec))


def test_rescaled_online_tau_is_unbiased_vanilla_is_frequency_weighted():
    r, v = wall("rescaled"), wall("vanilla")
    counts = v["updates_per_worker"]
    freq_point = float(np.dot(counts, B) / np.sum(counts))  # where the observed frequencies pull Vanilla
    assert counts[0] > counts[1] > counts[2] > 0
    assert abs(r["final_params"][0] - 3.0) < 0.2
    assert abs(v["final_params"][0] - freq_point) < 0.2
    assert abs(v["final_params"][0] - 3.0) > 1.0


def test_compute_time_estimator_also_works():
    r = wall("rescaled", manager=ManagerSettings(tau_estimator="compute"))
    assert abs(r["final_params"][0] - 3.0) < 0.2


def run_with_outage(strategy, down_for: float):
    """Run ``strategy`` on 3 threaded nodes (τ = 1, 2, 4 × 0.02 s, budget 200 units); worker 2's
    node leaves after 0.8 s and comes back ``down_for`` s later. Returns (result, events, window):
    one event per completion, (time, worker, rejected, model version after it); ``window["up"]``
    is the monotonic time the node came back."""
    grid = InProcessGrid(app, 3, threaded=True)
    events = []
    on_event = OnEvent(lambda comp, x: events.append(
        (time.monotonic(), comp.worker, comp.rejected, strategy.last_run.version)))
    gone = grid.node_ids[2]
    window = {}

    def outage():
        time.sleep(0.8)
        grid.set_online(gone, False)
        time.sleep(down_for)
        window["up"] = time.monotonic()
        grid.set_online(gone, True)

    t = threading.Thread(target=outage)
    cfg = {"task": "quadratic", "num-partitions": 3, "quad-a": [1.0] * 3, "quad-b": B}
    t.start()
    try:
        res = strategy.start(grid, ArrayRecord({"model": Array(np.zeros(1))}), time_budget=200,
                             train_config={"task": task_spec(cfg), "emulate": "fixed", "time-unit": 0.02},
                             clock=WallClock(0.02), timeout=5.0,
                             observers=[on_event], settings=ManagerSettings(worker_config=[{"tau": 1.0}, {"tau": 2.0}, {"tau": 4.0}],
                                                                      node_refresh=0.2))
    finally:
        t.join()
        grid.close()
    return res, events, window


def test_node_that_leaves_and_returns():
    s = RescaledASGD(lr=0.05)
    res, applied, _ = run_with_outage(s, down_for=1.0)
    books = s.last_run.manager.books
    lost = books.count("lost")
    assert lost[2] >= 1 and books.by_reason("lost").get("error-code-5", 0) >= 1
    down = [e for e in applied if e[1] == 2 and e[2] is not None]
    back = [e for e in applied if e[1] == 2 and e[2] is None and e[0] > down[-1][0]]
    assert back, "worker 2 got work again after its node came back"
    assert np.isfinite(res.arrays["model"].numpy()).all()
    # The node's error reply marked the job lost at once: nothing waited for the 5 s TTL.
    assert books.by_reason("lost").get("ttl-expired", 0) == 0
    rows = books.balance()  # every job sent is accounted for, the lost ones included
    assert all(r["balanced"] for r in rows) and rows[2]["lost"] == lost[2] and res.books["balanced"] == 1


@pytest.mark.parametrize("strategy_cls", [MaleniaSGD, RingleaderASGD, MinibatchSGD])
def test_round_based_methods_go_on_without_a_node_that_left(strategy_cls):
    """Malenia, Ringleader and Minibatch SGD wait for every worker in a round. A worker whose node
    left must not be waited for (the others keep updating the model), and when it comes back its
    gradients count again."""
    s = strategy_cls(lr=0.05)
    res, events, window = run_with_outage(s, down_for=1.2)
    lost = [e for e in events if e[1] == 2 and e[2] is not None]
    assert lost, "worker 2's job was lost when its node left"
    # While worker 2 is gone (from its lost job to its return) the model keeps moving.
    during = [e[3] for e in events if lost[0][0] < e[0] < window["up"]]
    assert during and during[-1] - during[0] >= 3, f"{s.name} stalled without worker 2"
    # After it returns its gradients are used again.
    back = [e for e in events if e[1] == 2 and e[2] is None and e[0] > window["up"]]
    assert back, "worker 2 delivered again after its node came back"
    assert np.isfinite(res.arrays["model"].numpy()).all()


def test_cancelling_a_job_whose_reply_is_already_buffered():
    """Wall clock: replies are pulled in batches, so a job may be cancelled after its reply was
    buffered (a round closing on another worker's reply). It must be dropped as wasted work, not
    handed to the strategy, and the next completion must be the other job."""
    from fl_rescaled import AsyncClientManager, ModelLayout
    from fl_rescaled.grid_api import as_async_grid

    grid = InProcessGrid(app, 3, threaded=True)
    cfg = {"task": "quadratic", "num-partitions": 3, "quad-a": [1.0] * 3, "quad-b": B}
    layout = ModelLayout.of(ArrayRecord({"model": Array(np.zeros(1))}))[0]
    m = AsyncClientManager(as_async_grid(grid), WallClock(0.01), layout=layout, train_config={"task": task_spec(cfg)})
    try:
        m.connect(3, partition_query=True)
        x = np.zeros(1)
        jobs = [m.send(w, x, 0) for w in range(3)]
        deadline = time.monotonic() + 10
        while len(m.transport.arrived) < 3 and time.monotonic() < deadline:  # all three replies buffered
            m.transport.accept(list(grid.pull_messages(list(m.transport.inflight))))
            time.sleep(0.01)
        assert len(m.transport.arrived) == 3
        first = m.next_completion()
        assert first is not None and first.ok
        cancelled = next(j for j in jobs if j.job_id != first.job.job_id)
        m.cancel(cancelled)
        second = m.next_completion()
        assert second is not None and second.ok
        assert {first.job.job_id, second.job.job_id, cancelled.job_id} == {j.job_id for j in jobs}
        row = m.books.balance()[cancelled.worker]
        assert row["discarded"] == 1 and row["applied"] == 0 and row["balanced"]
        assert m.books.wasted[cancelled.worker] > 0  # its reply had come: its compute time is wasted work
        assert not m.transport.inflight and not m.transport.arrived
    finally:
        grid.close()


class LiarApp:
    """The project's ClientApp, except that worker 0 reports a compute time of 1000 s per job."""

    def __init__(self, liar: int = 0, claim: float = 1000.0) -> None:
        self.liar, self.claim = liar, claim

    def __call__(self, msg, context):
        from flwr.app import MetricRecord

        reply = app(msg, context)
        if msg.metadata.message_type == "train" and int(context.node_config["partition-id"]) == self.liar:
            metrics = dict(reply.content["metrics"])
            metrics["compute-time"] = self.claim
            reply.content["metrics"] = MetricRecord(metrics)
        return reply


def test_a_client_that_lies_about_its_compute_time_gains_nothing():
    """With the compute-time estimator a client that claims a huge τ would become τ_max, raise its own
    step and shrink everybody else's; its claims are clamped to what the server observed, so the run
    lands on the same point as with honest clients."""
    def once(client):
        grid = InProcessGrid(client, 3, threaded=True)
        s = RescaledASGD(lr=0.05, fraction_evaluate=0.0)
        cfg = {"task": "quadratic", "num-partitions": 3, "quad-a": [1.0] * 3, "quad-b": B}
        try:
            s.start(grid, ArrayRecord({"model": Array(np.zeros(1))}), time_budget=200,
                    train_config={"task": task_spec(cfg), "emulate": "fixed", "time-unit": 0.02},
                    clock=WallClock(0.02), settings=ManagerSettings(tau_estimator="compute",
                                                             worker_config=[{"tau": t} for t in (1.0, 2.0, 4.0)]))
        finally:
            grid.close()
        return s

    honest, lied = once(app), once(LiarApp())
    taus = list(lied.last_run.taus.taus)
    assert taus[0] < 2.0, taus  # the liar's τ is what it really took (≈ 1), not the 1000 s it claimed
    assert abs(lied.last_run.x[0] - 3.0) < 0.2 and abs(lied.last_run.x[0] - honest.last_run.x[0]) < 0.3
    assert lied.last_run.manager.books.balance()[0]["balanced"]
