"""The example examples/fedavg-subclass: a FedAvg subclass's three features on an asynchronous base.

``CustomAsync(RescaledASGD)`` keeps a learning-rate schedule (``configure_job``), the best model
and a results file (``on_evaluation``) and a ``start()`` override that calls ``super().start``. Its
ServerApp and ClientApp run in process (``run_inprocess`` with the app's pyproject defaults plus
small overrides), on numpy and generated data. Each test checks one feature where it lands: the
learning rates the ClientApp trained with, the files the run wrote, what ``start`` did around the run.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import MetricRecord

from fl_rescaled import AsyncResult, RescaledASGD, run_inprocess

EXAMPLE_DIR = Path(__file__).resolve().parents[1] / "examples" / "fedavg-subclass"
TAUS = (1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0)  # 10 nodes; fraction-train 0.5: C = 5
LR0, HALF_LIFE, UPDATES = 0.5, 15.0, 60


@pytest.fixture
def example(monkeypatch, tmp_path):
    """The example's modules, imported from its folder; ``example.run()`` runs the app and returns what
    the ClientApp trained with, what ``on_evaluation`` saw (with a copy of each model) and the
    output folder ``example.out``."""
    monkeypatch.syspath_prepend(str(EXAMPLE_DIR))
    server_app = importlib.import_module("fedavg_subclass.server_app")
    client_app = importlib.import_module("fedavg_subclass.client_app")
    strategy = importlib.import_module("fedavg_subclass.strategy")
    assert Path(server_app.__file__).resolve().is_relative_to(EXAMPLE_DIR)

    client_lrs: list[float] = []
    train_model = client_app.train_model

    def recording_train(*args, **kwargs):
        client_lrs.append(kwargs["lr"])
        return train_model(*args, **kwargs)

    monkeypatch.setattr(client_app, "train_model", recording_train)

    seen: list[SimpleNamespace] = []
    on_evaluation = strategy.CustomAsync.on_evaluation

    def recording_on_evaluation(self, step, arrays, metrics):
        seen.append(SimpleNamespace(step=step, arrays={k: v.numpy().copy() for k, v in arrays.items()},
                                    metrics={k: dict(v) for k, v in metrics.items()}))
        on_evaluation(self, step, arrays, metrics)

    monkeypatch.setattr(strategy.CustomAsync, "on_evaluation", recording_on_evaluation)
    out = tmp_path / "outputs"

    def run(**overrides) -> SimpleNamespace:
        config = {"num-updates": UPDATES, "learning-rate": LR0, "lr-half-life": HALF_LIFE, "out-dir": str(out),
                  **overrides}
        result = run_inprocess(server_app.app, client_app.app, num_supernodes=len(TAUS), app_dir=EXAMPLE_DIR,
                               run_config=config, node_configs=[{"tau": t} for t in TAUS])
        return SimpleNamespace(result=result, client_lrs=client_lrs, seen=seen, out=out)

    return SimpleNamespace(run=run, out=out, server_app=server_app)


def _npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def test_the_learning_rate_schedule_reaches_the_clients(example):
    run = example.run()
    assert isinstance(run.result, AsyncResult) and run.result.books["updates"] == UPDATES
    # Every job's lr is the schedule's value at some update count k: lr0 · 0.5 ** (k / half-life).
    ks = [round(HALF_LIFE * math.log2(LR0 / lr)) for lr in run.client_lrs]
    for lr, k in zip(run.client_lrs, ks):
        assert lr == pytest.approx(LR0 * 0.5 ** (k / HALF_LIFE), rel=1e-12), (lr, k)
    # The first jobs start at lr0; the later ones follow the server's updates to the end of the run
    # (C = 5 jobs in flight: the last ones are sent after at least UPDATES − 5 updates).
    assert 0 in ks and min(ks) == 0
    assert max(ks) >= UPDATES - 5 and len(set(ks)) >= UPDATES // 2, sorted(set(ks))
    # The ClientApp reports the lr it used: each evaluation window's mean is below the last one's.
    train = run.result.train_metrics_clientapp
    window_lrs = [train[k]["lr"] for k in sorted(train)]
    assert len(window_lrs) >= 5 and all(b < a for a, b in zip(window_lrs, window_lrs[1:])), window_lrs
    # and the schedule trains: the central loss falls.
    central = run.result.evaluate_metrics_serverapp
    assert central[max(central)]["loss"] < 0.6 * central[0]["loss"], central


def test_results_json_has_one_entry_per_evaluation(example):
    run = example.run()
    progress = run.result.progress
    entries = json.loads((run.out / "results.json").read_text())
    assert [e["step"] for e in entries] == sorted(progress) == [s.step for s in run.seen]
    updates = [e["updates"] for e in entries]
    assert updates == [int(progress[k]["updates"]) for k in sorted(progress)]
    assert updates[0] == 0 and updates[-1] == UPDATES and all(b > a for a, b in zip(updates, updates[1:]))
    central = run.result.evaluate_metrics_serverapp
    for e in entries:
        assert e["server"] == pytest.approx(dict(central[e["step"]]))
        assert e["time"] == progress[e["step"]]["time"]
        if e["step"] > 0:
            assert e["train"]["lr"] == pytest.approx(run.result.train_metrics_clientapp[e["step"]]["lr"])


def test_the_best_model_is_the_evaluation_with_the_lowest_loss(example):
    run = example.run()
    best = min(run.seen, key=lambda s: s.metrics["server"]["loss"])
    saved = _npz(run.out / "best_model.npz")
    assert saved.keys() == best.arrays.keys() == {"weight", "bias"}
    for k in saved:
        np.testing.assert_array_equal(saved[k], best.arrays[k])
    assert json.loads((run.out / "summary.json").read_text())["best_step"] == best.step


def test_the_best_model_is_kept_when_later_evaluations_are_worse(example, monkeypatch):
    """A scripted central loss whose minimum is at evaluation 3 of 12 (60 updates, a point per 5, FedAvg's
    round of 5 nodes): the saved model is that point's, not the last one (which training alone would
    usually make the best)."""
    losses = [5.0, 4.0, 3.0, 0.5, 2.0, 1.0, 2.5, 0.75, 3.5, 1.5, 4.5, 2.25, 1.25]

    def scripted(examples):
        def evaluate_fn(step, arrays):
            return MetricRecord({"loss": losses[step]})
        return evaluate_fn

    monkeypatch.setattr(example.server_app, "central_evaluation", scripted)
    run = example.run()
    assert [s.metrics["server"]["loss"] for s in run.seen] == losses
    saved = _npz(run.out / "best_model.npz")
    at_3, last = run.seen[3].arrays, run.seen[-1].arrays
    assert any(not np.array_equal(at_3[k], last[k]) for k in at_3)
    for k in saved:
        np.testing.assert_array_equal(saved[k], at_3[k])
    assert json.loads((run.out / "summary.json").read_text())["best_step"] == 3


def test_the_start_override_runs_around_the_run(example):
    """Before the run: the output folder is made and a stale results.json removed; after it: the
    final model and summary.json."""
    example.out.mkdir(parents=True)
    (example.out / "results.json").write_text(json.dumps([{"step": 99, "updates": 999}]))
    run = example.run()
    entries = json.loads((run.out / "results.json").read_text())
    assert all(e["step"] != 99 for e in entries) and len(entries) == len(run.result.progress)
    final = _npz(run.out / "final_model.npz")
    for k, v in run.result.arrays.items():
        np.testing.assert_array_equal(final[k], v.numpy())
    summary = json.loads((run.out / "summary.json").read_text())
    assert summary["updates"] == UPDATES and summary["evaluations"] == len(run.result.progress)


def test_a_budget_is_required_and_named():
    """With no budget at all, start() names every budget it takes (FedAvg's num_rounds among them)."""
    with pytest.raises(ValueError, match="give a budget: num_rounds .FedAvg's work"):
        RescaledASGD(reply="model").start(grid=None, initial_arrays=None)


@pytest.mark.parametrize("hook,instead", [("configure_train", "configure_job"), ("aggregate_train", "update bounds"),
                                          ("configure_evaluate", "evaluate_config"),
                                          ("aggregate_evaluate", "on_evaluation")])
def test_a_subclass_keeping_a_round_hook_is_refused_with_its_replacement(hook, instead):
    """A FedAvg subclass that switched its base class but kept a round override would run with the
    override silently never called: the class is refused where it is defined, naming what to use."""
    with pytest.raises(TypeError, match=f"CustomFedAvg overrides {hook}.*{instead}"):
        type("CustomFedAvg", (RescaledASGD,), {hook: lambda self, *a, **k: None})
    type("CustomAsync", (RescaledASGD,), {"configure_job": lambda self, config, **k: config})  # the counterpart is fine
