"""What a Flower user expects of a budget, the evaluations and the ``Result`` (issue 29).

Before (main cc59dfd): the only budgets were ``num_updates`` and ``time_budget``, and one FedBuff
update is K trainings, so a user who kept FedAvg's number got K times more or less work; about
ten evaluation points were made whatever the budget (an Opacus app ran 110 client evaluations
under FedAsync where FedAvg ran 30 for the same trainings); the jobs left in flight at the end
went unmentioned; and ``run_inprocess`` returned None for Flower's own FedAvg.

Now ``start(num_trainings=...)`` counts client trainings, FedAvg's ``num_rounds × clients per
round``; the default evaluation cadence is one point per round's worth of trainings (C), with the
federated evaluation after each, so a run costs FedAvg's evaluations for the same trainings and its
``Result`` has FedAvg's keys; ``Result.progress[k]`` says where point k is (time, trainings,
updates).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Result, Strategy

import hostile
from conftest import run_of, start_run
from fl_rescaled import (AsyncResult, DelayModel, FedAsync, FedBuff, InProcessGrid, RescaledASGD, VirtualClock,
                         WallClock, run_inprocess)
from fl_rescaled.runstate import Checkpointing

N = 10
#: What the nodes of ``app`` were asked to do, by message type.
SEEN: dict[str, int] = {}

app = ClientApp()


def _target(context: Context) -> np.ndarray:
    return np.full(3, float(context.node_config.get("partition-id", 0)), np.float32)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """A FedAvg ClientApp: one local step toward the node's own point, the model back."""
    SEEN["train"] = SEEN.get("train", 0) + 1
    x = msg.content["arrays"]["w"].numpy()
    y = (x - 0.5 * (x - _target(context))).astype(np.float32)
    return Message(RecordDict({"arrays": ArrayRecord({"w": Array(y)}),
                               "metrics": MetricRecord({"train_loss": float(np.sum((x - _target(context)) ** 2)),
                                                        "num-examples": 10})}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    SEEN["evaluate"] = SEEN.get("evaluate", 0) + 1
    x = msg.content["arrays"]["w"].numpy()
    return Message(RecordDict({"metrics": MetricRecord({"eval_loss": float(np.sum((x - _target(context)) ** 2)),
                                                        "num-examples": 10})}), reply_to=msg)


def model() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros(3, np.float32))})


def central() -> tuple[list[int], object]:
    calls: list[int] = []

    def evaluate_fn(step: int, arrays: ArrayRecord) -> MetricRecord:
        calls.append(step)
        return MetricRecord({"loss": float(np.sum(arrays["w"].numpy() ** 2))})

    return calls, evaluate_fn


def hostile_run(strategy, n: int = 20, clock=None, **kwargs) -> AsyncResult:
    threaded = clock is not None and not clock.virtual
    return strategy.start(InProcessGrid(hostile.app, n, threaded=threaded),
                          ArrayRecord({"w": Array(np.zeros(hostile.DIM, np.float32))}),
                          clock=clock or VirtualClock(DelayModel([1.0 + i / 7 for i in range(n)])),
                          train_config={"reply": "model"}, **kwargs)


# ------------------------------------------------------------------ the budget
@pytest.mark.parametrize("wall", [False, True], ids=["virtual", "wall"])
def test_num_trainings_is_the_same_work_for_every_strategy_fedbuff_120_is_12_updates_fedasync_120(wall):
    for strategy, updates in ((FedBuff(buffer_size=10, fraction_evaluate=0.0), 12),
                              (FedAsync(fraction_evaluate=0.0), 120)):
        res = hostile_run(strategy, clock=WallClock(0.01) if wall else None, num_trainings=120)
        assert (res.books["trainings"], res.books["updates"]) == (120, updates)
        assert res.books["replies-accepted"] == 120 and res.books["rejected"] == 0
        assert res.progress[max(res.progress)]["trainings"] == 120


def test_two_work_budgets_together_are_refused_with_the_conversion():
    for two in ({"num_trainings": 120, "num_updates": 12}, {"num_rounds": 3, "num_trainings": 60},
                {"num_rounds": 3, "num_updates": 12}):
        with pytest.raises(ValueError, match=r"give one of num_rounds \(FedAvg's rounds: C client trainings each\), "
                                             r"num_trainings \(client trainings\) and num_updates"):
            hostile_run(FedBuff(), **two)
    for name in ("num_trainings", "num_rounds"):
        for bad in (0, -3, 2.5, True, "12"):
            with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
                hostile_run(FedBuff(), **{name: bad})


@pytest.mark.parametrize("cls", [FedAsync, FedBuff, RescaledASGD])
@pytest.mark.parametrize("nodes", [4, 10])
def test_num_rounds_kept_from_fedavg_is_fedavgs_work_on_any_number_of_nodes(cls, nodes):
    """The switch from FedAvg may keep ``num_rounds``: the run does FedAvg's trainings for the nodes
    there are (rounds × C, C = max(min_train_nodes, ⌊fraction_train · nodes⌋): 2 of 4 nodes, 5 of
    10), its evaluations, and its Result keys."""
    rounds, fraction = 3, 0.5
    SEEN.clear()
    ref = FedAvg(fraction_train=fraction, fraction_evaluate=0.5).start(InProcessGrid(app, nodes), model(),
                                                                       num_rounds=rounds)
    fedavg = dict(SEEN)
    SEEN.clear()
    strategy = cls(fraction_train=fraction, fraction_evaluate=0.5,
                   **({"reply": "model"} if cls is RescaledASGD else {}))
    res = strategy.start(InProcessGrid(app, nodes), model(), num_rounds=rounds)
    c = max(2, int(fraction * nodes))
    assert res.books["trainings"] == fedavg["train"] == rounds * c
    assert SEEN["evaluate"] == fedavg["evaluate"]
    assert sorted(res.evaluate_metrics_clientapp) == sorted(ref.evaluate_metrics_clientapp) == list(range(1, rounds + 1))
    assert [res.progress[k]["trainings"] for k in sorted(res.progress)] == [k * c for k in range(rounds + 1)]


def test_a_rejected_reply_is_a_training_and_a_lost_job_is_not():
    """The hostile node's replies (1e38 everywhere) are delivered and rejected: they count, as the
    work the client did; the books still balance, and the run stops at exactly its budget."""
    grid = hostile.HostileGrid("1e38")
    res = RescaledASGD(fraction_evaluate=0.0).start(
        grid, ArrayRecord({"w": Array(np.zeros(hostile.DIM, np.float32))}), num_trainings=60,
        clock=VirtualClock(DelayModel(hostile.TAUS)), train_config={"reply": "gradient"}, partition_query=True)
    books = res.books
    assert books["trainings"] == 60 == books["replies-accepted"] + books["rejected"]
    assert books["rejected"] > 0 and books["updates"] == books["replies-accepted"] < 60
    assert books["jobs-sent"] == 60 + books["lost"] + books["in-flight"] + books["discarded"]


@pytest.mark.parametrize("budget", [{"num_trainings": 100}, {"num_rounds": 25}], ids=["trainings", "rounds"])
def test_a_run_resumed_from_its_checkpoint_ends_at_the_same_trainings_and_points(tmp_path, budget):
    def start(resume: bool):
        s = FedBuff(buffer_size=4, fraction_train=0.5, fraction_evaluate=0.0)  # (C = 4 of 8: 25 rounds, 100)
        calls, evaluate_fn = central()
        res = start_run(s, InProcessGrid(hostile.app, 8), ArrayRecord({"w": Array(np.zeros(hostile.DIM, np.float32))}),
                        **budget, clock=VirtualClock(DelayModel([1.0 + i / 5 for i in range(8)])),
                        train_config={"reply": "model"}, evaluate_fn=evaluate_fn,
                        checkpoint=Checkpointing(tmp_path / "run.ckpt", 7.0, "trainings", resume=resume))
        return s, res, calls

    first, res1, calls1 = start(False)
    assert run_of(first).manager.clock.now > 7.0
    second, res2, calls2 = start(True)
    assert run_of(second).trainings == 100 == res2.books["trainings"] and res2.books["updates"] == 25
    assert res2.arrays["w"].numpy().tobytes() == res1.arrays["w"].numpy().tobytes()
    assert {k: dict(v) for k, v in res2.progress.items()} == {k: dict(v) for k, v in res1.progress.items()}
    assert calls2 and calls2 == [k for k in calls1 if k >= calls2[0]]  # (the points after the checkpoint, again)


def test_the_checkpoint_of_a_run_with_another_budget_is_refused(tmp_path):
    from fl_rescaled.checkpoints import CheckpointError

    def start(resume: bool, **budget):
        return FedBuff(buffer_size=4, fraction_evaluate=0.0).start(
            InProcessGrid(hostile.app, 4), ArrayRecord({"w": Array(np.zeros(hostile.DIM, np.float32))}),
            clock=VirtualClock(DelayModel(hostile.TAUS)), train_config={"reply": "model"},
            checkpoint=Checkpointing(tmp_path / "run.ckpt", 5.0, "budget", resume=resume), **budget)

    start(False, num_trainings=80)
    for other in ({"num_trainings": 40}, {"num_rounds": 20}):  # (20 rounds of C = 4 are 80 trainings: another budget)
        with pytest.raises(CheckpointError):
            start(True, **other)


# ------------------------------------------------------------------ evaluations at FedAvg's cost
def fedavg_counts(num_rounds: int) -> tuple[dict[str, int], list[int], Result]:
    SEEN.clear()
    calls, evaluate_fn = central()
    res = FedAvg(fraction_train=0.5, fraction_evaluate=0.4).start(InProcessGrid(app, N), model(), num_rounds=num_rounds,
                                                                  evaluate_fn=evaluate_fn)
    return dict(SEEN), calls, res


@pytest.mark.parametrize("cls", [FedAsync, FedBuff])
def test_the_default_evaluations_cost_what_fedavgs_do_for_the_same_trainings(cls):
    """FedAvg, 6 rounds of 5 of 10 nodes, evaluating on 4 after each: 30 trainings, 24 client
    evaluations, ``evaluate_fn`` at rounds 0 to 6. The asynchronous strategy with the same options
    and ``num_trainings=30`` does the same work and the same evaluations, under the same keys."""
    fedavg, fedavg_calls, ref = fedavg_counts(6)
    assert fedavg == {"train": 30, "evaluate": 24}
    SEEN.clear()
    calls, evaluate_fn = central()
    res = cls(fraction_train=0.5, fraction_evaluate=0.4).start(InProcessGrid(app, N), model(), num_trainings=30,
                                                               evaluate_fn=evaluate_fn)
    assert res.books["trainings"] == 30 and SEEN["evaluate"] == fedavg["evaluate"]
    assert calls == fedavg_calls == list(range(7))
    for name in ("evaluate_metrics_clientapp", "evaluate_metrics_serverapp", "train_metrics_clientapp"):
        assert sorted(getattr(res, name)) == sorted(getattr(ref, name)), name
    assert [res.progress[k]["trainings"] for k in sorted(res.progress)] == [0, 5, 10, 15, 20, 25, 30]


def test_the_cadence_stays_an_option_num_evaluations_or_eval_every():
    SEEN.clear()
    res = FedAsync(fraction_train=0.5, fraction_evaluate=0.4).start(InProcessGrid(app, N), model(), num_trainings=30,
                                                                    num_evaluations=2)
    assert sorted(res.evaluate_metrics_clientapp) == [1, 2] and SEEN["evaluate"] == 2 * 4
    assert [res.progress[k]["trainings"] for k in (1, 2)] == [15, 30]
    res = FedAsync(fraction_train=0.5, fraction_evaluate=0.0).start(InProcessGrid(app, N), model(), time_budget=10.0,
                                                                    eval_every=2.5)
    assert [res.progress[k]["time"] for k in sorted(res.progress)] == [0.0, 2.5, 5.0, 7.5, 10.0]


# ------------------------------------------------------------------ the Result and the log
def test_the_jobs_left_in_flight_are_counted_in_the_result_and_said_in_the_log(caplog):
    caplog.set_level(logging.INFO, logger="flwr.fl_rescaled")
    res = hostile_run(FedAsync(fraction_evaluate=0.0), num_trainings=50)
    assert res.books["in-flight"] == 20 and res.books["jobs-sent"] == 70
    assert "20 jobs still in flight at the end were not applied (counted in Result.books['in-flight'])" in caplog.text


server = ServerApp()


@server.main()
def fedavg_main(grid: Grid, context: Context) -> None:
    FedAvg(fraction_evaluate=0.0).start(grid=grid, initial_arrays=model(), num_rounds=2)


def test_run_inprocess_returns_flowers_own_result_too():
    original = Strategy.start
    res = run_inprocess(server, app, 4)
    assert type(res) is Result and sorted(res.train_metrics_clientapp) == [1, 2]
    assert Strategy.start is original  # (Flower's strategies are as they were once the call ends)


def test_finish_in_flight_waits_for_the_last_jobs_and_applies_them(caplog):
    caplog.set_level(logging.INFO, logger="flwr.fl_rescaled")
    res = hostile_run(FedAsync(fraction_evaluate=0.0), num_trainings=50, finish_in_flight=True)
    books = res.books
    assert books["in-flight"] == 0 and books["jobs-sent"] == 70  # (no job sent once the budget was spent)
    assert books["trainings"] == books["updates"] == 70 and books["lost"] == 0
    assert res.progress[max(res.progress)]["updates"] == 70  # (the end point sees them)
    assert "waiting for the 20 jobs still in flight (finish_in_flight)" in caplog.text
    assert "not applied" not in caplog.text
    res = hostile_run(FedBuff(buffer_size=10, fraction_evaluate=0.0), num_trainings=50, finish_in_flight=True)
    assert res.books["trainings"] == 70 and res.books["updates"] == 7  # (a buffer fills once more)
    res = hostile_run(FedAsync(fraction_evaluate=0.0), time_budget=5.0, finish_in_flight=True)
    assert res.books["in-flight"] == 0 and res.progress[max(res.progress)]["time"] > 5.0


def test_the_command_line_and_the_run_config_take_num_trainings():
    from fl_rescaled.experiment import RunSpec, run
    from fl_rescaled.server_app import spec_from_run_config

    spec = spec_from_run_config({"task": "quadratic", "taus": "1,2", "num-trainings": 30, "budget": 1000.0})
    assert spec.num_trainings == 30 and spec_from_run_config({"num-trainings": ""}).num_trainings is None
    out = run(RunSpec(task="quadratic", taus=[1.0, 2.0], num_trainings=30, budget=1000.0, strategy="fedbuff",
                      options={"buffer_size": 3}, workers=1))
    assert (out["trainings"], out["num_updates"]) == (30, 10) and out["final_time"] < 1000.0
    with pytest.raises(SystemExit):  # (a bad value: one line and exit 2)
        from fl_rescaled import cli

        cli.build_parser().parse_args(["--num-trainings", "0"])
