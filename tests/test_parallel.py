"""Parallel in-flight execution on the in-process Grid: the same trajectory, bit for bit, whatever the
number of threads and whether the jobs are computed ahead or when the loop needs them."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from conftest import quad
from fl_rescaled import FedBuff, InProcessGrid, run_inprocess
from fl_rescaled.experiment import RunSpec, run

MODES = [dict(workers=1), dict(workers=2), dict(workers=3, ahead=True)]


def same_run(a: dict, b: dict) -> None:
    assert a["num_updates"] == b["num_updates"] and a["updates_per_worker"] == b["updates_per_worker"]
    np.testing.assert_array_equal(a["final_model"], b["final_model"])
    assert [h["time"] for h in a["history"]] == [h["time"] for h in b["history"]]
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]
    assert a["discarded_per_worker"] == b["discarded_per_worker"] and a["rejected"] == b["rejected"]


@pytest.mark.parametrize("strategy", ["delay-adaptive", "malenia", "fedbuff"])
def test_quadratic_runs_do_not_depend_on_the_threads(strategy):
    kw = dict(strategy=strategy, taus=[1, 2, 3, 5], quad_a=[1, 2, 1, 3], quad_b=[0, 2, -1, 4], quad_dim=3,
              noise=0.3, lr=0.05, budget=60, eval_every=3, delays="exponential", seed=4)
    runs = [quad(**kw, **mode) for mode in MODES]
    for other in runs[1:]:
        same_run(runs[0], other)
    if strategy == "malenia":
        assert sum(runs[0]["discarded_per_worker"]) > 0  # cancelled jobs, on every path


@pytest.mark.mnist
def test_mnist_runs_do_not_depend_on_the_threads(mnist_cache):
    base = RunSpec(task="mnist", strategy="rescaled", budget=30, eval_every=3, lr=1.0, seed=3, delays="exponential")
    runs = [run(RunSpec(**{**base.__dict__, **mode})) for mode in MODES]
    for other in runs[1:]:
        same_run(runs[0], other)
    assert runs[0]["num_updates"] > 50


#: How long the first job of partition 0 holds its node open for the node's second job (pooled run).
WINDOW = 1.0


def test_a_user_app_gets_the_same_result_with_a_pool_and_each_node_runs_one_job_at_a_time():
    """Two jobs per node, pushed together: with a pool of 4 threads the second could start while the
    first runs. The first job of partition 0 holds the node open until its second job starts (or
    ``WINDOW`` seconds pass, which it does when the node's jobs run one at a time): without the
    per-node lock the second starts at once, on another pool thread, and the overlap is seen. (The
    window is not a bound on anything measured: it only gives a missing lock time to show.)"""
    running: dict[int, int] = {}
    overlaps = []
    count = threading.Lock()
    gate = {"armed": False, "second": threading.Event()}

    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        node = context.node_id
        pid = int(context.node_config["partition-id"])
        seq = int(msg.content["config"]["job-seq"])
        with count:
            running[node] = running.get(node, 0) + 1
            overlaps.append(running[node])
        if gate["armed"] and pid == 0 and seq == 1:
            gate["second"].set()
        if gate["armed"] and pid == 0 and seq == 0:
            gate["second"].wait(WINDOW)
        w = msg.content["arrays"]["w"].numpy()
        rng = np.random.default_rng((pid, seq))
        y = w - 0.1 * 2 * (w - pid - rng.normal(0, 0.1, w.shape))
        with count:
            running[node] -= 1
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(y)}),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    results = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        results.append(FedBuff(buffer_size=3, jobs_per_node=2, fraction_evaluate=0.0).start(
            grid=grid, initial_arrays=ArrayRecord({"w": Array(np.zeros(4))}), train_config=ConfigRecord({}),
            time_budget=50.0))

    configs = [{"tau": t} for t in (1.0, 2.0, 3.0, 1.5)]
    for workers in (1, 4):
        gate["armed"] = workers > 1
        run_inprocess(server, client, 4, node_configs=configs, workers=workers)
    first, second = results
    np.testing.assert_array_equal(first.arrays["w"].numpy(), second.arrays["w"].numpy())
    assert dict(first.books) == {**dict(second.books), "time": first.books["time"]}
    assert max(overlaps) == 1  # two jobs of one node never ran at once
    assert gate["second"].is_set()  # (the second job of partition 0 did run in the pooled run)


def test_the_pool_runs_submitted_work_and_waits_for_replies():
    grid = InProcessGrid(ClientApp(), 2, workers=2)
    try:
        assert grid.submit(sum, [1, 2, 3]).result(timeout=10) == 6
        assert InProcessGrid(ClientApp(), 1).submit(sum, [1]) is None  # no pool: the caller runs it
    finally:
        grid.close()
