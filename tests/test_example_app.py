"""The example app examples/quickstart-async, run in process, and a gradient-replying ClientApp.

* The example's own ServerApp and ClientApp (a FedAvg ClientApp) with each asynchronous strategy
  and with Flower's FedAvg, on real MNIST, through ``run_inprocess`` with the app's pyproject
  defaults plus small overrides.
* A ClientApp written only against Flower's API that replies with gradients, driven by
  ``RescaledASGD()`` from a tiny inline ServerApp.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from fl_rescaled import AsyncResult, FedBuff, RescaledASGD, run_inprocess

EXAMPLE_DIR = Path(__file__).resolve().parents[1] / "examples" / "quickstart-async"
TAUS = (1.0, 1.0, 2.0, 2.0, 4.0)  # heterogeneous compute times of the 5 in-process nodes
SMALL = {"examples-per-client": 300, "fraction-evaluate": 0.5, "learning-rate": 0.05}


@pytest.fixture
def single_thread():
    """Torch on one thread: on a 2-core machine shared with other work, its default thread pool
    makes these tiny batches many times slower (the Ray actors of Flower's engine run so too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def example(monkeypatch, mnist_cache, single_thread):
    """The example's modules, imported from its folder, with ``report`` captured."""
    monkeypatch.syspath_prepend(str(EXAMPLE_DIR))
    server_app = importlib.import_module("quickstart_async.server_app")
    client_app = importlib.import_module("quickstart_async.client_app")
    assert Path(server_app.__file__).resolve().is_relative_to(EXAMPLE_DIR)
    runs: list[SimpleNamespace] = []
    report = server_app.report

    def capture(name, initial, result):
        runs.append(SimpleNamespace(name=name, initial=initial, result=result))
        report(name, initial, result)

    monkeypatch.setattr(server_app, "report", capture)

    def run(**overrides) -> SimpleNamespace:
        run_inprocess(server_app.app, client_app.app, num_supernodes=len(TAUS), app_dir=EXAMPLE_DIR,
                      run_config={**SMALL, **overrides}, node_configs=[{"tau": t} for t in TAUS])
        assert len(runs) == 1, "the ServerApp reports once per run"
        return runs.pop()

    return run


def _changes(initial: ArrayRecord, final: ArrayRecord) -> dict[str, float]:
    """Per array of the model (same keys, shapes and dtypes): how far its largest entry moved."""
    a, b = initial.to_torch_state_dict(), final.to_torch_state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
    return {k: float((b[k] - a[k]).abs().max()) for k in a}


def assert_every_array_trained(initial: ArrayRecord, final: ArrayRecord) -> None:
    """Training moved every array of the model (Net's weights and biases, all floats), not only some:
    a reply whose arrays were read or applied only in part would leave the others where they were."""
    changes = _changes(initial, final)
    assert all(v > 0 for v in changes.values()), changes


#: Replies each server update takes: one (Rescaled ASGD, FedAsync), a full buffer (FedBuff: its default
#: for the app's fraction-train of 0.25 on 5 nodes, 2 jobs in flight, is K = 2). A run of
#: ``num-trainings`` stops at exactly that many replies, so its updates are the trainings over this.
REPLIES_PER_UPDATE = {"rescaled": 1, "fedasync": 1, "fedbuff": FedBuff(fraction_train=0.25).buffer_for(len(TAUS))}


@pytest.mark.mnist
@pytest.mark.parametrize("strategy, num_trainings", [("rescaled", 60), ("fedasync", 30), ("fedbuff", 40)])
def test_example_runs_async(example, strategy, num_trainings):
    run = example(strategy=strategy, **{"num-trainings": num_trainings})
    result = run.result
    assert run.name == strategy and isinstance(result, AsyncResult)

    books = result.books
    num_updates = num_trainings // REPLIES_PER_UPDATE[strategy]
    assert books["updates"] == num_updates and books["trainings"] == num_trainings
    assert books["replies-accepted"] == num_trainings
    assert books["rejected"] == 0 and not any(k.startswith("rejected.") for k in books)
    assert_every_array_trained(run.initial, result.arrays)

    fed = result.evaluate_metrics_clientapp  # (as FedAvg's: rounds 1, 2, ..., a round's worth being 2 trainings)
    assert sorted(fed) == list(range(1, num_trainings // 2 + 1)), fed.keys()
    first, last = fed[min(fed)], fed[max(fed)]
    assert result.progress[max(fed)]["updates"] == num_updates
    assert last["eval_loss"] < 0.9 * first["eval_loss"], (first, last)
    assert last["eval_acc"] > 0.3  # chance is 0.1
    train = result.train_metrics_clientapp
    assert train and all(set(rec) == {"train_loss"} for rec in train.values())  # as FedAvg: the weight key left out


@pytest.mark.mnist
def test_example_fedbuff_takes_its_buffer_size_from_the_run_config(example):
    run = example(strategy="fedbuff", **{"num-trainings": 12, "buffer-size": 4})
    books = run.result.books
    assert books["updates"] == 3 and books["replies-accepted"] == 12  # 4 replies per update, not FedBuff's 10
    assert_every_array_trained(run.initial, run.result.arrays)


@pytest.mark.mnist
def test_example_turns_on_differential_privacy_from_the_run_config(example):
    run = example(strategy="fedbuff", **{"num-trainings": 12, "buffer-size": 4, "dp-clipping-norm": 0.5,
                                         "dp-noise-multiplier": 1.0})
    dp = run.result.privacy
    assert dp["releases"] == 3 and sum(dp["contributions"]) == 12 and dp["max_epsilon"] > 0


@pytest.mark.mnist
def test_example_runs_fedavg(example):
    run = example(strategy="fedavg", **{"num-server-rounds": 2})
    result = run.result
    assert type(result) is Result  # Flower's own FedAvg, not an asynchronous strategy
    assert_every_array_trained(run.initial, result.arrays)
    assert sorted(result.evaluate_metrics_clientapp) == [1, 2]
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    assert result.evaluate_metrics_clientapp[2]["eval_acc"] > 0.2


# ------------------------------------------------------------ a gradient-replying ClientApp
# Linear regression y = x·w* + b* + noise, the same (w*, b*) on every node: the ClientApp answers a
# job with the gradient of its minibatch loss at the model it received, under the model's own keys.
W_STAR = np.array([[1.5, -2.0, 0.5, 1.0]], dtype=np.float32)
B_STAR = np.array([0.7], dtype=np.float32)


def _node_data(partition_id: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(100 + partition_id)
    x = rng.normal(size=(n, W_STAR.shape[1])).astype(np.float32)
    y = x @ W_STAR.T + B_STAR + 0.01 * rng.normal(size=(n, 1)).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(y)


def _model(arrays: ArrayRecord) -> torch.nn.Linear:
    model = torch.nn.Linear(W_STAR.shape[1], 1)
    model.load_state_dict(arrays.to_torch_state_dict())
    return model


gradient_app = ClientApp()


@gradient_app.train()
def _gradient_train(msg: Message, context: Context) -> Message:
    model = _model(msg.content["arrays"])
    x, y = _node_data(int(context.node_config["partition-id"]))
    batch = torch.randperm(len(x))[:16]
    loss = 0.5 * torch.nn.functional.mse_loss(model(x[batch]), y[batch])
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    content = RecordDict({"arrays": ArrayRecord(grads),
                          "metrics": MetricRecord({"loss": loss.item(), "num-examples": len(batch)})})
    return Message(content=content, reply_to=msg)


@gradient_app.evaluate()
def _gradient_evaluate(msg: Message, context: Context) -> Message:
    model = _model(msg.content["arrays"])
    x, y = _node_data(int(context.node_config["partition-id"]))
    with torch.no_grad():
        loss = 0.5 * torch.nn.functional.mse_loss(model(x), y).item()
    return Message(content=RecordDict({"metrics": MetricRecord({"loss": loss, "num-examples": len(x)})}),
                   reply_to=msg)


def test_gradient_clientapp_with_rescaled_asgd(single_thread):
    torch.manual_seed(0)
    initial = torch.nn.Linear(W_STAR.shape[1], 1).state_dict()
    data = [_node_data(i) for i in range(len(TAUS))]

    def central(step: int, arrays: ArrayRecord) -> MetricRecord:
        model = _model(arrays)
        with torch.no_grad():
            losses = [0.5 * torch.nn.functional.mse_loss(model(x), y).item() for x, y in data]
        return MetricRecord({"loss": float(np.mean(losses))})

    out: dict[str, AsyncResult] = {}
    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        out["result"] = RescaledASGD().start(grid=grid, initial_arrays=ArrayRecord(initial), num_updates=200,
                                             train_config=ConfigRecord({}), evaluate_fn=central)

    run_inprocess(server, gradient_app, num_supernodes=len(TAUS), node_configs=[{"tau": t} for t in TAUS])
    result = out["result"]

    assert result.books["updates"] == 200 and result.books["rejected"] == 0
    central_loss = result.evaluate_metrics_serverapp
    assert central_loss[max(central_loss)]["loss"] < 0.01 * central_loss[0]["loss"], central_loss
    fed = result.evaluate_metrics_clientapp  # (every node's data, as the central loss: from point 1, as FedAvg's)
    assert sorted(fed) == list(range(1, max(fed) + 1)) and max(fed) == max(central_loss)
    assert fed[max(fed)]["loss"] < 0.01 * central_loss[0]["loss"]
    train = result.train_metrics_clientapp
    assert train[max(train)]["loss"] < 0.05 * train[min(train)]["loss"]

    final = result.arrays.to_torch_state_dict()
    assert list(final) == list(initial) == ["weight", "bias"]
    for k in initial:
        assert final[k].shape == initial[k].shape and final[k].dtype == initial[k].dtype == torch.float32
    np.testing.assert_allclose(final["weight"].numpy(), W_STAR, atol=0.05)
    np.testing.assert_allclose(final["bias"].numpy(), B_STAR, atol=0.05)


# ---------------------------------------------------------------------------------------------- 50 nodes, 12 at a time
FIFTY_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_fifty_nodes.py"


@pytest.fixture
def fifty(monkeypatch, mnist_cache, single_thread):
    """``run(strategy, seed, compare)``: the example's ClientApp on 50 in-process nodes with
    ``fraction_train=0.25`` and heterogeneous compute times (τ from 1 to 16), through
    benchmarks/bench_fifty_nodes.py (the measurement behind the docstrings below: ``python
    benchmarks/bench_fifty_nodes.py``). Returns (final central accuracy, client trainings)."""
    monkeypatch.syspath_prepend(str(EXAMPLE_DIR))
    spec = importlib.util.spec_from_file_location("bench_fifty_nodes", FIFTY_BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    client = importlib.import_module("quickstart_async.client_app").app

    def run(strategy: str, seed: int, compare: str = "trainings") -> tuple[float, int]:
        budget = bench.budget_for(strategy, compare, trainings=120, virtual_time=48.0)
        return bench.fifty_nodes(client, strategy, seed, bench.POPULATIONS["het"], **budget)

    return run


@pytest.mark.mnist
@pytest.mark.slow
def test_fifty_nodes_twelve_at_a_time_async_strategies_match_fedavg_at_equal_trainings(fifty):
    """The issue's app: 50 nodes, ``fraction_train=0.25``, speeds from 1 to 16. All strategies get
    the same 120 client trainings: FedAvg 10 rounds of 12, FedBuff 120 / K updates, FedAsync and
    Rescaled 120 updates. The test takes the median of seeds 0-2. Measured over seeds 0-9 with 250
    examples per node (docs/population.md, "12 of 50 at a time"):

    - FedAvg's median is 0.903.
    - FedBuff with a buffer of 4 (a third of the 12 jobs in flight) reaches 0.930, and each of its
      ten seeds is above FedAvg's median.
    - FedAsync reaches 0.913 and Rescaled 0.910. Both are on par with FedAvg: the median of three
      seeds moves by more than their lead.
    - FedBuff with a buffer of 10 (its default then) reached 0.894: ten of the 12 jobs in flight
      fill a buffer, so most of a step's replies were computed before the previous step. Its
      default now follows the jobs in flight: 6 here.

    Those numbers predate the default update bounds (the median clip); with them, seeds 0-4
    (docs/population.md, "How many replies a step, and how far"): FedAvg 0.910, FedAsync 0.906,
    Rescaled 0.907, FedBuff (6) 0.910. Two torch threads instead of one change a median by at most
    0.002.

    The test asserts that FedBuff(4) is at least FedAvg, that FedAsync and Rescaled are within 0.01
    of it, and that FedBuff with its default buffer is within 0.03. Before concurrency (all 50 nodes
    at once) the gaps were 0.3 to 0.45, and the test fails on those."""
    medians = {}
    for strategy in ("flower-fedavg", "fedbuff:4", "fedasync", "rescaled", "fedbuff"):
        runs = [fifty(strategy, seed) for seed in range(3)]
        assert all(t == 120 for _, t in runs), (strategy, runs)
        medians[strategy] = float(np.median([a for a, _ in runs]))
    fedavg = medians["flower-fedavg"]
    assert fedavg > 0.85, medians
    assert medians["fedbuff:4"] >= fedavg, medians
    for strategy in ("fedasync", "rescaled"):
        assert medians[strategy] >= fedavg - 0.01, medians
    assert medians["fedbuff"] >= fedavg - 0.03, medians


@pytest.mark.mnist
@pytest.mark.slow
def test_fifty_nodes_heterogeneous_speeds_async_strategies_beat_fedavg_at_equal_virtual_time(fifty):
    """τ from 1 to 16: a synchronous round (``fedavg``: FedAvg's sampled rounds on the virtual clock)
    waits for the slowest of its 12 clients, the asynchronous strategies never wait. Over 48 time
    units FedAvg trains 36 times (3 rounds), the others 105 (measured, seed 0, 250 examples per client:
    FedAvg 0.681; FedAsync 0.916, Rescaled 0.913, FedBuff 0.867). Each must be ahead by 0.05 at least."""
    acc = {s: fifty(s, 0, compare="time") for s in ("fedavg", "fedbuff", "fedasync", "rescaled")}
    assert acc["fedavg"][1] == 36
    for s in ("fedbuff", "fedasync", "rescaled"):
        assert acc[s][1] > 2 * acc["fedavg"][1] and acc[s][0] > acc["fedavg"][0] + 0.05, acc
