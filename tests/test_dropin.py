"""A drop-in for FedAvg: a ClientApp written only against Flower's API (state-dict layout, model
replies with ``num-examples``, no partition query) works unchanged; wrong replies and broken
ClientApps fail loudly; budgets, evaluation and metrics behave as a Flower user expects."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from conftest import (TOY1, fedasync_rule, fedbuff_rule, local_steps_factor, quad, replay, rescaled_rule, run_of,
                      start_run, virtual_order)
from fl_rescaled.manager import OnEvent
from fl_rescaled import (
    FedAsync,
    FedBuff,
    InProcessGrid,
    RescaledASGD,
    RunFailed,
    VanillaASGD,
    WallClock,
    add_partition_query,
)

TARGETS = [np.array([4.0, 4.0, 4.0]), np.array([-3.0, -3.0, -3.0]), np.array([1.0, 1.0, 1.0])]
H = 3  # local steps of the FedAvg-style client


def initial() -> ArrayRecord:
    """A model with a float32 matrix, a float16 vector and an int64 counter (a BatchNorm-like buffer)."""
    return ArrayRecord({"w": Array(np.zeros((2, 3), np.float32)), "b": Array(np.zeros(3, np.float16)),
                        "num_batches_tracked": Array(np.array(0, np.int64))})


def fedavg_client(*, hello: bool = False, fail: str | None = None, evaluate: bool = False, arrays_key: str = "arrays",
                  config_key: str = "config", tags: list | None = None, echo_under: str | None = None) -> ClientApp:
    """What a FedAvg user writes: load the arrays, train H steps on F_i(θ) = ‖θ − b_i‖², reply the
    trained arrays (same keys and dtypes) and ``num-examples``. Knows nothing of fl_rescaled.
    ``arrays_key``/``config_key``: the record names it reads and writes; ``tags``: a list each job's
    config is appended to; ``echo_under``: a second ArrayRecord, the arrays received, under that name."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        state = {k: v.numpy() for k, v in msg.content[arrays_key].items()}
        if tags is not None:
            tags.append(dict(msg.content[config_key].items()))
        if fail == "raise":
            raise KeyError("learning-rate")
        assert state["w"].dtype == np.float32 and state["b"].dtype == np.float16
        assert state["num_batches_tracked"].dtype == np.int64 and state["num_batches_tracked"].shape == ()
        pid = int(context.node_config["partition-id"])
        lr = float(msg.content[config_key]["lr"])
        w, b = state["w"].astype(np.float64), state["b"].astype(np.float64)
        for _ in range(H):
            w -= lr * 2 * (w - TARGETS[pid])
            b -= lr * 2 * (b - TARGETS[pid])
        out = {"w": Array(w.astype(np.float32)), "b": Array(b.astype(np.float16)),
               "num_batches_tracked": Array(np.asarray(state["num_batches_tracked"] + H))}
        if fail == "flat":  # our old convention: one flat vector under "model"
            out = {"model": Array(np.concatenate([w.ravel(), b.ravel()]).astype(np.float32))}
        metrics = {"train_loss": float(np.sum((w - TARGETS[pid]) ** 2)), "num-examples": pid + 1,
                   "partition": float(pid)}
        content = RecordDict({arrays_key: ArrayRecord(out), "metrics": MetricRecord(metrics)})
        if echo_under is not None:
            content[echo_under] = msg.content[arrays_key]
        return Message(content, reply_to=msg)

    if evaluate:
        @app.evaluate()
        def evaluate_fn(msg: Message, context: Context) -> Message:
            w = msg.content["arrays"]["w"].numpy()
            pid = int(context.node_config["partition-id"])
            metrics = {"eval_loss": float(np.sum((w - TARGETS[pid]) ** 2)), "num-examples": 1}
            return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    if hello:
        add_partition_query(app)
    return app


def grid_of(app: ClientApp, taus=(1.0, 2.0), **kw) -> InProcessGrid:
    return InProcessGrid(app, len(taus), node_configs=[{"tau": float(t)} for t in taus], **kw)


def w_of(result) -> np.ndarray:
    return result.arrays["w"].numpy()


# ---------------------------------------------------------------------------------------------- layout
# Each strategy, and its server rule for the reference run (conftest.replay). Rescaled with α = 1
# (its default, FedAsync's pace, depends on the population; the rule replayed needs the α used).
LAYOUT_RUNS = {
    "fedbuff": (lambda: FedBuff(buffer_size=2), fedbuff_rule(2, 0.5)),
    "fedasync": (lambda: FedAsync(), fedasync_rule(0.6, 0.5)),
    "rescaled": (lambda: RescaledASGD(reply="model", lr=1.0), rescaled_rule((1.0, 2.0), 1.0)),
}


@pytest.mark.parametrize("name", list(LAYOUT_RUNS))
def test_an_unchanged_fedavg_clientapp_trains_in_its_own_layout(name):
    make, rule = LAYOUT_RUNS[name]
    strategy = make()
    result = strategy.start(grid=grid_of(fedavg_client()), initial_arrays=initial(),
                            train_config=ConfigRecord({"lr": 0.05}), num_updates=60)
    assert result.books["updates"] == 60 and result.books["rejected"] == 0
    arrays = result.arrays
    assert list(arrays.keys()) == ["w", "b", "num_batches_tracked"]
    assert arrays["w"].numpy().dtype == np.float32 and arrays["w"].numpy().shape == (2, 3)
    assert arrays["b"].numpy().dtype == np.float16
    counter = arrays["num_batches_tracked"].numpy()
    # Carried, never stepped: the latest accepted reply's counter, a whole number of local steps.
    assert counter.dtype == np.int64 and counter.shape == () and int(counter) % H == 0 and int(counter) > 0
    # Where the model is after 60 server updates: the method's rule replayed on the same schedule
    # (τ = 1, 2 on the virtual clock; every weight of w sees targets 4 and −3; H = 3 local steps of
    # 0.05). The run's model is float32: every update rounds x to a float32 (|x| < 4: an error below
    # 4 · 2^−24 ≈ 2.4e-7 each) and no update amplifies an earlier error (each is a convex
    # combination of the model and the clients' points), so 60 updates stay within
    # 60 · 2.4e-7 · a few ≈ 1e-4 of the exact run. A summed buffer, a lost update or another
    # staleness weight moves the end by more than 0.01.
    expected = replay(virtual_order((1.0, 2.0)), [TARGETS[0][0], TARGETS[1][0]], local_steps_factor(0.05, H), rule,
                      steps=60)
    np.testing.assert_allclose(w_of(result), expected, atol=1e-4, rtol=0)
    import torch  # noqa: F401  (Flower converts to torch only when torch is imported)

    assert tuple(result.arrays.to_torch_state_dict()["w"].shape) == (2, 3)


def test_renamed_records_are_read_and_written_under_the_names_given():
    # A ClientApp that reads and replies under "weights" and "cfg", and also echoes the model it got
    # under "arrays": the run is the same, bit for bit, as with Flower's default names (a reply read
    # under a hard-coded "arrays" would take the echo, and the model would never move).
    def run(**keys):
        app = fedavg_client(arrays_key=keys.get("arrayrecord_key", "arrays"),
                            config_key=keys.get("configrecord_key", "config"),
                            echo_under="arrays" if keys else None)
        return RescaledASGD(reply="model", lr=1.0, **keys).start(
            grid=grid_of(app), initial_arrays=initial(), train_config=ConfigRecord({"lr": 0.05}), num_updates=20)

    renamed, default = run(arrayrecord_key="weights", configrecord_key="cfg"), run()
    assert renamed.books["updates"] == 20 and renamed.books["rejected"] == 0
    np.testing.assert_array_equal(w_of(renamed), w_of(default))
    assert np.abs(w_of(renamed)).max() > 0.1  # (it moved)


def test_every_job_carries_its_tags():
    # messages.py: job-id, worker, version (updates the model has seen), job-seq (the worker's job
    # number) and server-round (version + 1), beside the user's train_config.
    tags: list = []
    taus = (1.0, 2.0, 3.0)
    RescaledASGD(reply="model", lr=1.0).start(grid=grid_of(fedavg_client(hello=True, tags=tags), taus=taus),
                                              initial_arrays=initial(), train_config=ConfigRecord({"lr": 0.05}),
                                              num_updates=12)
    n = len(taus)
    tags.sort(key=lambda t: t["job-id"])  # (the grid runs them in the order they finish)
    assert len(tags) >= 12 and len({t["job-id"] for t in tags}) == len(tags)
    assert all(t["lr"] == 0.05 for t in tags)
    seqs: dict = {}
    for t in tags:
        assert t["job-seq"] == seqs.get(t["worker"], 0)  # 0, 1, 2, ... per worker
        seqs[t["worker"]] = t["job-seq"] + 1
        # Every worker starts on x_0; after that each reply is applied, then its worker gets the new
        # model: job n - 1 + k carries the model of k updates.
        assert t["version"] == max(0, t["job-id"] - n + 1)
        assert t["server-round"] == t["version"] + 1
    assert sorted(seqs) == list(range(n))


def test_the_default_strategies_are_constructible_with_no_arguments():
    for cls in (RescaledASGD, VanillaASGD, FedAsync, FedBuff):
        s = cls()
        assert s.lr == 1.0 and s.reply in ("gradient", "model")
    assert FedAsync().reply == FedBuff().reply == RescaledASGD(reply="model").reply == "model"
    assert RescaledASGD().reply == "gradient"
    with pytest.raises(TypeError):
        RescaledASGD(0.1)  # options are keyword-only, as documented once on the constructor
    with pytest.raises(ValueError, match="reply"):
        RescaledASGD(reply="delta")


def test_without_partition_query_workers_follow_node_ids_said_at_debug_level_only(caplog):
    """Numbering the workers by node id is nothing a user must act on (per-partition settings that
    need the partition query refuse to start, below): a DEBUG line, no warning."""
    caplog.set_level(logging.DEBUG, logger="flwr.fl_rescaled")
    grid = grid_of(fedavg_client(), taus=(1.0, 2.0, 4.0))
    s = RescaledASGD(reply="model")
    result = start_run(s, grid=grid, initial_arrays=initial(), train_config={"lr": 0.05}, time_budget=20)
    assert result.books["rejected"] == 0 and result.books["updates"] > 0
    said = [r for r in caplog.records if "numbered by node id" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.DEBUG] and "add_partition_query" in said[0].getMessage()
    manager = run_of(s).manager
    nodes = manager.membership.roster.node_ids
    assert nodes == sorted(grid.node_ids)
    # Each worker runs at its own node's τ (from its node config): 20 / τ updates each.
    assert manager.books.updates.tolist() == [round(20 / grid.node_config(n)["tau"]) for n in nodes]


def test_per_partition_weights_without_the_partition_query_refuse_to_start():
    grid = grid_of(fedavg_client(), taus=(1.0, 2.0))
    with pytest.raises(RuntimeError, match="add_partition_query") as info:
        RescaledASGD(reply="model", weights=[0.3, 0.7]).start(grid=grid, initial_arrays=initial(),
                                                               train_config={"lr": 0.05}, time_budget=5)
    assert "partition" in str(info.value)
    assert grid.messages_pushed == 2  # the two queries; no training job was sent
    # With the query answered, the same weights are accepted.
    ok = RescaledASGD(reply="model", weights=[0.3, 0.7]).start(
        grid=grid_of(fedavg_client(hello=True)), initial_arrays=initial(), train_config={"lr": 0.05}, time_budget=5)
    assert ok.books["updates"] > 0


# ---------------------------------------------------------------------------------------------- loud failures
def test_a_clientapp_that_raises_stops_the_run_with_its_own_exception_text():
    with pytest.raises(RunFailed) as info:
        FedBuff().start(grid=grid_of(fedavg_client(fail="raise")), initial_arrays=initial(),
                        train_config={"lr": 0.05}, num_updates=10)
    msg = str(info.value)
    assert "KeyError" in msg and "learning-rate" in msg and "error-code-2" in msg
    books = info.value.books
    # An error reply is a lost job, counted once (not also as a rejection).
    assert books["updates"] == 0 and books["lost.error-code-2"] == books["lost"] >= 2 and books["rejected"] == 0


def test_replies_in_another_layout_stop_the_run_naming_the_expected_arrays():
    with pytest.raises(RunFailed) as info:
        RescaledASGD(reply="model").start(grid=grid_of(fedavg_client(fail="flat")), initial_arrays=initial(),
                                           train_config={"lr": 0.05}, num_updates=10)
    msg = str(info.value)
    assert "malformed" in msg and "missing 'w', 'b'" in msg and "unexpected 'model'" in msg
    assert "'w': float32[2, 3]" in msg


def test_too_many_rejections_in_a_row_stop_a_run_that_went_bad():
    app = ClientApp()
    calls = {"n": 0}

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        calls["n"] += 1
        w = msg.content["arrays"]["w"].numpy()
        g = w - 1.0 if calls["n"] <= 10 else np.full_like(w, np.nan)  # fine at first, then NaN forever
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(g.astype(np.float32))}),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    start = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    with pytest.raises(RunFailed, match="5 replies in a row were rejected") as info:
        RescaledASGD(max_consecutive_rejections=5).start(grid=grid_of(app), initial_arrays=start, time_budget=1000)
    assert info.value.books["updates"] == 10
    assert "non-finite" in str(info.value)


def test_run_sim_exits_non_zero_with_the_reason(monkeypatch, capsys):
    from fl_rescaled import cli, experiment

    def failing(spec, grid=None, **kw):
        raise RunFailed("the run cannot make progress: no reply could be used")

    monkeypatch.setattr(experiment, "run", failing)
    rc = cli.main(["--task", "quadratic", "--strategy", "rescaled", "--budget", "5"])
    err = capsys.readouterr().err
    assert rc == 1 and "no reply could be used" in err and "Traceback" not in err


def test_the_serverapp_fails_the_run_when_no_reply_can_be_used():
    from fl_rescaled import run_inprocess
    from fl_rescaled.server_app import app as server_app

    broken = ClientApp()

    @broken.train()
    def train(msg: Message, context: Context) -> Message:
        raise RuntimeError("deliberate: this client is broken")

    add_partition_query(broken)
    with pytest.raises(RunFailed, match="deliberate: this client is broken"):
        run_inprocess(server_app, broken, 2, run_config={"task": "quadratic", "taus": "1,2", "budget": 10.0})


# ---------------------------------------------------------------------------------------------- budgets, metrics
def test_num_updates_stops_exactly_and_num_evaluations_spreads_ten_points_over_it():
    seen = []
    result = RescaledASGD(reply="model").start(
        grid=grid_of(fedavg_client()), initial_arrays=initial(), train_config={"lr": 0.05}, num_updates=37,
        num_evaluations=10,
        evaluate_fn=lambda step, arrays: seen.append(step) or MetricRecord({"w0": float(arrays["w"].numpy()[0, 0])}))
    assert result.books["updates"] == 37
    assert seen == list(range(11))  # the start, then every 4 updates (⌈37/10⌉), and the end
    updates = [int(result.progress[s]["updates"]) for s in seen]
    assert updates == [0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 37]  # every ⌈37/10⌉ updates, and the end
    assert set(result.evaluate_metrics_serverapp[0]) == {"w0"}  # the user's own metrics, nothing mixed in
    with pytest.raises(ValueError, match="budget"):
        RescaledASGD().start(grid=grid_of(fedavg_client()), initial_arrays=initial())
    seen.clear()  # by default: a point per round's worth of trainings (2 nodes: every 2), and the end
    result = RescaledASGD(reply="model").start(
        grid=grid_of(fedavg_client()), initial_arrays=initial(), train_config={"lr": 0.05}, num_updates=37,
        evaluate_fn=lambda step, arrays: seen.append(step) or MetricRecord({"w0": float(arrays["w"].numpy()[0, 0])}))
    assert seen == list(range(20))
    assert [int(result.progress[s]["trainings"]) for s in seen] == [*range(0, 37, 2), 37]


def test_a_time_budget_with_ten_evaluations_gives_ten_points_and_weighted_reply_metrics():
    grid = grid_of(fedavg_client(hello=True, evaluate=True), taus=(1.0, 1.0, 1.0))
    result = FedAsync(fraction_evaluate=2 / 3).start(grid=grid, initial_arrays=initial(),
                                                     train_config={"lr": 0.05}, time_budget=20.0,
                                                     num_evaluations=10, partition_query=True)
    assert sorted(result.train_metrics_clientapp) == list(range(1, 11))
    for step, rec in result.train_metrics_clientapp.items():
        # Every worker replied equally often: the mean of "partition" weighted by num-examples = pid + 1.
        assert rec["partition"] == pytest.approx((0 * 1 + 1 * 2 + 2 * 3) / 6)
        # As FedAvg aggregates: the weight key is left out, nothing of ours is mixed in.
        assert set(rec) == {"partition", "train_loss"}
        progress = result.progress[step]
        assert progress["replies"] > 0 and progress["time"] == pytest.approx(2.0 * step)
    fed = result.evaluate_metrics_clientapp
    assert sorted(fed) == list(range(1, 11))  # (as FedAvg: the nodes evaluate after a round, not before the first)
    assert all(set(rec) == {"eval_loss"} and np.isfinite(rec["eval_loss"]) for rec in fed.values())


def test_fedavgs_metric_keywords_aggregate_as_fedavg_does_lists_included():
    """train_metrics_aggr_fn / evaluate_metrics_aggr_fn get the window's replies as FedAvg hands them
    a round's (RecordDicts, the weight key); min_evaluate_nodes sets how many nodes evaluate; with
    no function, a list metric is averaged element by element, weighted by num-examples."""
    seen: dict[str, list[int]] = {"train": [], "evaluate": []}

    def count(kind):
        def aggregate(records, key):
            assert key == "num-examples" and all(isinstance(r, RecordDict) for r in records)
            seen[kind].append(len(records))
            return MetricRecord({"replies": len(records)})
        return aggregate

    grid = grid_of(fedavg_client(hello=True, evaluate=True), taus=(1.0, 1.0, 1.0))
    result = FedAsync(fraction_evaluate=0.1, min_evaluate_nodes=2, train_metrics_aggr_fn=count("train"),
                      evaluate_metrics_aggr_fn=count("evaluate")).start(
        grid=grid, initial_arrays=initial(), train_config={"lr": 0.05}, time_budget=20.0, num_evaluations=10,
        partition_query=True)
    assert seen["evaluate"] == [2] * 10  # max(min_evaluate_nodes, ⌊0.1 · 3⌋) = 2 nodes, every point after the start
    assert seen["train"] == [6] * 10  # 3 nodes, τ = 1, 2 time units per window
    assert all(rec["replies"] == 6 for rec in result.train_metrics_clientapp.values())

    from fl_rescaled.reporting import MetricWindow

    w = MetricWindow("num-examples")
    w.add({"num-examples": 1, "per-class": [1.0, 0.0], "loss": 2.0})
    w.add({"num-examples": 3, "per-class": [0.0, 1.0], "loss": 4.0})
    w.add({"num-examples": 2, "per-class": [1.0, 2.0, 3.0], "loss": float("nan")})  # another length; NaN: dropped
    assert w.record() == {"per-class": [0.25, 0.75], "loss": 3.5}


def test_default_clock_virtual_in_process_wall_on_a_threaded_grid_counting_from_start():
    s = RescaledASGD(reply="model")
    start_run(s, grid=grid_of(fedavg_client(), taus=(1.0, 4.0)), initial_arrays=initial(),
            train_config={"lr": 0.05}, time_budget=40)
    assert run_of(s).virtual
    assert run_of(s).manager.books.updates.tolist() == [40, 10]  # τ = 1 and 4 from the node configs

    # The wall clock counts from start(), as FedAvg's execution time does: its origin (time.monotonic()
    # − now, read in the first event) comes after start() was called and before the first job was
    # sent. (An ordering of time stamps, not a duration.)
    clock = WallClock()
    first = []
    s = RescaledASGD(reply="model")
    hook = OnEvent(lambda comp, x: first.append((time.monotonic() - clock.now * clock.time_unit,
                                                 comp.job.pushed_at)) if not first else None)
    grid = grid_of(fedavg_client(), threaded=True)
    called = time.monotonic()
    try:
        start_run(s, grid=grid, initial_arrays=initial(), train_config={"lr": 0.05}, time_budget=0.3, clock=clock,
                observers=[hook])
    finally:
        grid.close()
    assert not run_of(s).virtual
    assert first, "no job completed"
    origin, pushed = first[0]
    assert called <= origin <= pushed
    s = RescaledASGD(reply="model")
    grid = grid_of(fedavg_client(), threaded=True)
    try:
        start_run(s, grid=grid, initial_arrays=initial(), train_config={"lr": 0.05}, num_updates=5)
    finally:
        grid.close()
    assert isinstance(run_of(s).manager.clock, WallClock)  # a Grid without virtual time runs on the wall clock


# ---------------------------------------------------------------------------------------------- reply="model" fixed points
B = TOY1["quad_b"]  # (4, −3); the curvatures a vary below


def _quadratic(strategy: str, a, taus, **options) -> float:
    out = quad(strategy=strategy, taus=list(taus), quad_a=list(a), quad_b=B, lr=0.02, budget=6000,
               options={"reply": "model", **options}, local_steps=5, local_lr=0.05, eval_every=6000)
    return out["final_params"][0]


def _point(weights, a, b=B, eta=0.05, steps=5) -> float:
    c = [local_steps_factor(eta, steps, ai) for ai in a]
    return sum(w * ci * bi for w, ci, bi in zip(weights, c, b)) / sum(w * ci for w, ci in zip(weights, c))


def test_rescaled_with_model_replies_lands_on_the_equal_weight_point_vanilla_and_fedasync_do_not():
    taus = (1.0, 2.0)
    equal, freq = _point([1, 1], [1, 1]), _point([2, 1], [1, 1])
    assert equal == pytest.approx(0.5) and freq == pytest.approx(5 / 3)
    assert _quadratic("rescaled", [1, 1], taus) == pytest.approx(equal, abs=0.02)
    assert _quadratic("vanilla", [1, 1], taus) == pytest.approx(freq, abs=0.05)
    # FedAsync mixes fast clients' models in more often, and with less staleness discount: its rule
    # replayed on the same schedule (6000 time units, float64 like the run: the two differ only in
    # the order of roundings, ~1e-16 per update over 9000 updates). It lands past the frequency
    # point, on the side of the fast client (4): 2.21 here, where the staleness weights
    # 1 + 1/√2 (the fast client, δ = 0 and 1 per cycle) against 1/√3 (the slow one, δ = 2) put it.
    fedasync = _quadratic("fedasync", [1, 1], taus, mixing=0.05)
    expected = replay(virtual_order(taus, 6000), B, local_steps_factor(0.05, 5), fedasync_rule(0.05, 0.5))
    assert fedasync == pytest.approx(expected, abs=1e-9)
    s0, s1 = 1 + 2 ** -0.5, 3 ** -0.5
    assert expected == pytest.approx((s0 * B[0] + s1 * B[1]) / (s0 + s1), abs=0.1) and expected > freq + 0.5


def test_rescaled_with_model_replies_and_unequal_curvature_has_the_local_steps_drift():
    a, taus = (1.0, 4.0), (1.0, 2.0)
    drift = _point([1, 1], a)  # c_i = 1 − (1 − 2 η a_i)^H: the stiffer client pulls harder
    exact = (1 * 4.0 + 4 * -3.0) / 5  # the minimiser of F_1 + F_2
    assert abs(drift - exact) > 0.2
    assert _quadratic("rescaled", a, taus) == pytest.approx(drift, abs=0.02)


def test_a_float_reply_of_any_width_is_cast_other_kinds_are_refused():
    """A float array of the model takes floats of any width: a float32 reply to a float64 model is
    cast up (as FedAvg's averaging promotes), a float64 reply to a float32 model cast down. Integers
    or booleans for a float array, or floats for an integer (carried) array, are refused, naming
    both dtypes."""
    from fl_rescaled.errors import RejectedReply
    from fl_rescaled.layout import ModelLayout

    wide, _, _ = ModelLayout.of(ArrayRecord({"w": Array(np.zeros(3)), "n": Array(np.zeros(1, np.int64))}))
    narrow, _, _ = ModelLayout.of(ArrayRecord({"w": Array(np.zeros(3, np.float32))}))
    up = ArrayRecord({"w": Array(np.full(3, 0.1, np.float32)), "n": Array(np.ones(1, np.int32))})
    flat, carried = wide.flatten(up)
    assert flat.dtype == np.float64 and flat.tolist() == [float(np.float32(0.1))] * 3
    assert carried["n"].dtype == np.int64 and carried["n"].tolist() == [1]
    flat, _ = narrow.flatten(ArrayRecord({"w": Array(np.full(3, 0.1))}))
    assert flat.dtype == np.float32 and flat.tolist() == [float(np.float32(0.1))] * 3
    for layout, rec, match in (
            (narrow, ArrayRecord({"w": Array(np.ones(3, np.int64))}), "is int64, expected float32"),
            (narrow, ArrayRecord({"w": Array(np.ones(3, bool))}), "is bool, expected float32"),
            (wide, ArrayRecord({"w": Array(np.zeros(3)), "n": Array(np.ones(1))}), "is float64, expected int64")):
        with pytest.raises(RejectedReply, match=match) as info:
            layout.flatten(rec)
        assert info.value.reason == "wrong-dtype"


def slow_start(seconds: float) -> ClientApp:
    """A FedAvg ClientApp whose every node sleeps ``seconds`` before its first job (a runtime's start-up)."""
    inner, started = fedavg_client(), set()

    class SlowStart(ClientApp):
        def __call__(self, message, context):
            if context.node_id not in started:
                started.add(context.node_id)
                time.sleep(seconds)
            return inner(message, context)

    return SlowStart()


def test_a_time_budget_spent_in_the_nodes_start_up_says_what_to_do():
    """The wall clock's budget counts from ``start()``: one shorter than the nodes' start-up ends with
    no reply at all, and the run says so and what to give instead (one line, ``RunFailed``)."""
    grid = grid_of(slow_start(0.5), threaded=True)
    try:
        with pytest.raises(RunFailed, match=r"0 replies accepted.*no reply arrived within the budget: give a larger "
                                            r"time_budget \(on Flower's runtimes it counts from start\(\), the nodes' "
                                            r"start-up included\) or a num_trainings budget"):
            RescaledASGD(reply="model", fraction_evaluate=0.0).start(
                grid=grid, initial_arrays=initial(), train_config={"lr": 0.05}, time_budget=0.1, clock=WallClock())
    finally:
        grid.close()


def test_the_log_reads_as_flowers_and_its_wall_clock_counts_from_start(caplog):
    """On Flower's runtimes the nodes take a while to start (Ray's actors, a SuperNode's process).
    The wall clock counts from ``start()`` on every runtime, as FedAvg's "Strategy execution
    finished in" does: the log's first time stamp after an update is no earlier than the nodes'
    start-up (each node here sleeps 0.2 s before its first job). The log is Flower's: its INFO
    lines, drawn as FedAvg's, and no warning the user cannot act on. (An ordering of times: the
    sleep is a lower bound of the first reply's time, whatever the machine.)"""
    caplog.set_level(logging.INFO, logger="flwr")
    caplog.set_level(logging.INFO, logger="flwr.fl_rescaled")
    grid = grid_of(slow_start(0.2), threaded=True)
    try:
        result = RescaledASGD(reply="model", fraction_evaluate=0.0).start(
            grid=grid, initial_arrays=initial(), train_config={"lr": 0.05}, num_updates=6)
    finally:
        grid.close()
    assert result.books["updates"] == 6
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("flwr")]
    points = [line for line in lines if line.startswith("[t=")]
    first = next(line for line in points if not line.endswith("| 0 updates] train: -"))
    assert float(first.split("=", 1)[1].split(" ", 1)[0]) >= 0.2, first
    assert min(p["time"] for p in result.progress.values() if p["updates"] > 0) >= 0.2
    for expected in ("Starting RescaledASGD strategy:", "\t├──> Options:", "\t│\t├── reply: model",
                     "\t└──> Keys in records:", "\t\t├── Weighted by: 'num-examples'", "Final results:"):
        assert expected in lines, expected
    assert lines.index("Starting RescaledASGD strategy:") < lines.index(first) < lines.index("Final results:")
    assert any(line.startswith("Strategy execution finished in ") for line in lines)
