"""Wall-clock mode: arrival order, online τ estimates, nodes that leave and come back.

These runs use the in-process Grid in threaded mode (one thread per node, replies pulled when
ready) with emulated compute times: the clients sleep τ_i × time-unit seconds per job. Nothing
here depends on how fast the machine is: outages are driven by events (a node leaves after the
k-th completion and comes back a number of completions later), runs that must outlast something
are bounded by their number of updates, and times are only compared with each other.
"""

import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fl_rescaled.clients.client_app import app
from fl_rescaled import InProcessGrid, MaleniaSGD, MinibatchSGD, RescaledASGD, RingleaderASGD, WallClock
from fl_rescaled.experiment import RunSpec, run
from fl_rescaled.manager import ManagerObserver, ManagerSettings, OnEvent
from fl_rescaled.tasks import task_spec
from conftest import run_of, start_run

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


#: The outage: worker 2's node leaves after this many completions ...
DOWN_AFTER = 20
#: ... and comes back once this many completions followed its first lost job.
UP_AFTER_LOST = 20


def run_with_outage(strategy, updates: int):
    """Run ``strategy`` on 3 threaded nodes (τ = 1, 2, 4 × 0.02 s) for ``updates`` server updates;
    worker 2's node leaves after the ``DOWN_AFTER``-th completion and comes back ``UP_AFTER_LOST``
    completions after worker 2's first lost job (its next job after the node left fails at once with
    Flower's NODE_UNAVAILABLE: the node is listed as long as it has a job in flight). Returns
    (result, events, window): one event per completion, (index, worker, rejected, model version
    after it); ``window``: the event indices of the leave (``down``), of worker 2's first lost job
    (``lost``) and of the return (``up``).

    ``updates`` must outlast the return: from it, worker 2 rejoins at the next node refresh (every
    0.05 s) and a partition query, then delivers after its 0.08 s job; the other two nodes deliver
    at most 75 times a second (their jobs sleep 0.02 and 0.04 s), so at most ~15 completions pass
    meanwhile, on any machine (a slower one only leaves more time). A time budget of 60 s only stops
    a run that stalls (then the checks below fail)."""
    grid = InProcessGrid(app, 3, threaded=True)
    events = []
    gone = grid.node_ids[2]  # partition 2: worker 2
    window: dict[str, int] = {}

    def on_event(comp, x):
        i = len(events)
        events.append((i, comp.worker, comp.rejected, run_of(strategy).version))
        if i + 1 == DOWN_AFTER:
            window["down"] = i
            grid.set_online(gone, False)
        if "down" in window and "lost" not in window and comp.worker == 2 and comp.rejected is not None:
            window["lost"] = i
        if "lost" in window and "up" not in window and i - window["lost"] >= UP_AFTER_LOST:
            window["up"] = i
            grid.set_online(gone, True)

    cfg = {"task": "quadratic", "num-partitions": 3, "quad-a": [1.0] * 3, "quad-b": B}
    try:
        res = start_run(strategy, grid, ArrayRecord({"model": Array(np.zeros(1))}), num_updates=updates,
                             time_budget=3000, train_config={"task": task_spec(cfg), "emulate": "fixed",
                                                             "time-unit": 0.02},
                             clock=WallClock(0.02), timeout=60.0, observers=[OnEvent(on_event)],
                             settings=ManagerSettings(worker_config=[{"tau": 1.0}, {"tau": 2.0}, {"tau": 4.0}],
                                                      node_refresh=0.05))
    finally:
        grid.close()
    return res, events, window


def test_node_that_leaves_and_returns():
    s = RescaledASGD(lr=0.05)
    res, events, window = run_with_outage(s, updates=200)  # (up after ~50 completions: 150 to spare)
    books = run_of(s).manager.books
    lost = books.count("lost")
    assert set(window) == {"down", "lost", "up"}, window
    assert lost[2] >= 1 and books.by_reason("lost").get("error-code-5", 0) >= 1
    down = [e for e in events if e[1] == 2 and e[2] is not None]
    assert all(window["down"] < e[0] <= window["up"] for e in down)  # lost only while the node was gone
    back = [e for e in events if e[1] == 2 and e[2] is None and e[0] > window["up"]]
    assert back, "worker 2 got work again after its node came back"
    assert np.isfinite(res.arrays["model"].numpy()).all()
    # The node's error reply marked the job lost at once: nothing waited for the TTL.
    assert books.by_reason("lost").get("ttl-expired", 0) == 0
    rows = books.balance()  # every job sent is accounted for, the lost ones included
    assert all(r["balanced"] for r in rows) and rows[2]["lost"] == lost[2] and res.books["balanced"] == 1


@pytest.mark.parametrize("strategy_cls", [MaleniaSGD, RingleaderASGD, MinibatchSGD])
def test_round_based_methods_go_on_without_a_node_that_left(strategy_cls):
    """Malenia, Ringleader and Minibatch SGD wait for every worker in a round. A worker whose node
    left must not be waited for (the others keep updating the model), and when it comes back its
    gradients count again."""
    s = strategy_cls(lr=0.05)
    # (rounds of the two fast workers take 2 time units, of all three 4: the return comes after
    # about 10 updates, and 50 more take at least 2 s of emulated compute)
    res, events, window = run_with_outage(s, updates=60)
    assert "lost" in window, "worker 2's job was lost when its node left"
    assert "up" in window, f"{s.name} stalled without worker 2 (no completions after its loss)"
    # While worker 2 is gone (from its lost job to its return) the model keeps moving: the
    # UP_AFTER_LOST completions in between are the other workers', and at least a third of a
    # round's completions... each round of workers 0 and 1 takes three (τ = 1, 2): ~6 rounds.
    during = [e[3] for e in events if window["lost"] < e[0] <= window["up"]]
    assert [e[1] for e in events if window["lost"] < e[0] <= window["up"]].count(2) == 0
    assert during[-1] - during[0] >= 3, f"{s.name} stalled without worker 2"
    # After it returns its gradients are used again.
    back = [e for e in events if e[1] == 2 and e[2] is None and e[0] > window["up"]]
    assert back, "worker 2 delivered again after its node came back"
    assert np.isfinite(res.arrays["model"].numpy()).all()


def completed(m):
    """The manager's steps of an update for its next job to end (``Driver.update``'s 1 to 4)."""
    comp, reply = m.next_ended()
    m.validate(comp, reply)
    m.apply_bounds(comp)
    m.book(comp)
    return comp


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
        first = completed(m)
        assert first is not None and first.ok
        cancelled = next(j for j in jobs if j.job_id != first.job.job_id)
        m.cancel(cancelled)
        second = completed(m)
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
    step and shrink everybody else's; its claims are clamped to what the server observed, so it gets
    no more than its share of the steps, and the run lands where its steps put it."""
    class Seen(ManagerObserver):
        """The longest time from a job's dispatch to its completion the server saw, per worker."""

        def __init__(self):
            self.longest = [0.0, 0.0, 0.0]

        def completed(self, comp):
            seen = time.monotonic() - comp.job.pushed_at  # (read after the manager's own reading)
            self.longest[comp.worker] = max(self.longest[comp.worker], seen)

    def once(client):
        grid = InProcessGrid(client, 3, threaded=True)
        s = RescaledASGD(lr=0.05, fraction_evaluate=0.0)
        s.seen = Seen()
        cfg = {"task": "quadratic", "num-partitions": 3, "quad-a": [1.0] * 3, "quad-b": B}
        try:
            start_run(s, grid, ArrayRecord({"model": Array(np.zeros(1))}), time_budget=200,
                    train_config={"task": task_spec(cfg), "emulate": "fixed", "time-unit": 0.02},
                    clock=WallClock(0.02), observers=[s.seen],
                    settings=ManagerSettings(tau_estimator="compute",
                                             worker_config=[{"tau": t} for t in (1.0, 2.0, 4.0)]))
        finally:
            grid.close()
        return s

    honest, lied = once(app), once(LiarApp())
    taus = list(run_of(lied).periods.taus)
    # The liar's τ is an average of its claims clamped to what the server saw: never above the longest
    # dispatch-to-reply time of its jobs (in time units), however busy the machine. (Its claim is
    # 1000 s = 50,000 units; no job of this 200-unit run can have been seen to take that long.)
    assert taus[0] <= lied.seen.longest[0] / 0.02, (taus, lied.seen.longest)
    for s in (honest, lied):
        books = run_of(s).manager.books
        share = books.stepsize_per_worker / books.stepsize_sum
        # Rescaled ASGD gives each worker 1/3 of the steps. A believed claim would give the liar
        # nearly all of them (its γ = α/3, the others' ≈ α/3 · τ_i / 50,000); clamped to what the
        # server saw (its τ plus the server's overhead o per delivery), it gets 1 / (1 + Σ_i τ_i / (τ_i + o))
        # of them: less than 1/2 while o is under 3 time units (60 ms) per delivery.
        assert share[0] < 0.5, share
        # The run lands on the point its own steps weight: Σ S_i b_i / Σ S_i (S_i: worker i's steps
        # added up). Off it: what is left of the start x0 = 0, 3 · exp(−2 Σ S) (the gradient is
        # 2 (x − b_i)), and the last few steps, each under γ_max · 6 = 0.05 / 3 · 6 = 0.1.
        weighted = float(np.dot(share, B))
        tol = 3.0 * np.exp(-2.0 * books.stepsize_sum) + 0.1
        assert abs(run_of(s).x[0] - weighted) < tol, (run_of(s).x[0], weighted, tol)
        assert all(row["balanced"] for row in books.balance())
