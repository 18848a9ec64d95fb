"""The torch helper (``fl_rescaled.torch_batch``): its batched replies equal its unbatched ClientApp's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fl_rescaled import InProcessGrid
from fl_rescaled.batching import batch_entry
from fl_rescaled.torch_batch import torch_client_app

nn, F = torch.nn, torch.nn.functional


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, kernel_size=3)
        self.fc = nn.Linear(3 * 3 * 3, 4)

    def forward(self, x):
        return self.fc(torch.flatten(F.max_pool2d(F.relu(self.conv(x)), 2), 1))


def tiny_data(context: Context):
    """40 generated 8×8 images and 4-class labels per partition."""
    g = torch.Generator().manual_seed(100 + int(context.node_config["partition-id"]))
    return torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 4, (40,), generator=g)


def _models(n: int) -> list[ArrayRecord]:
    out = []
    for i in range(n):
        torch.manual_seed(i)
        out.append(ArrayRecord(TinyCNN().state_dict()))
    return out


def _arrays(rep: Message) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in rep.content["arrays"].items()}


def _app(**kw):
    return torch_client_app(TinyCNN, F.cross_entropy, tiny_data, batch_size=8, local_steps=3, lr=0.1, **kw)


@pytest.mark.parametrize("vmap", [True, None])
@pytest.mark.parametrize("with_seq,workers", [(True, 1), (False, 1), (False, 2)])
def test_batched_replies_equal_the_unbatched_clientapps(with_seq, workers, vmap):
    """Without ``job-seq`` a node counts its jobs in its context: node 0's two jobs keep their order
    even when the batch's calls (two jobs each) could run on two threads. With ``vmap=True`` the
    batch call trains the jobs in one ``vmap`` (equal up to rounding); by default, on the CPU, one
    job after the other inside the call (the same bits as one by one)."""
    torch.set_num_threads(1)
    replies = {}
    for batch in (False, True):
        # (ahead=False: unbatched, the jobs run when pulled, in push order; computed ahead on the pool, a
        # pull returns only the replies already done, which left the lists unaligned under load)
        grid = InProcessGrid(_app(chunk=2, vmap=vmap), 3, workers=workers, batch=batch, ahead=False)
        nodes = list(grid.get_node_ids())
        msgs = []
        for j, model in enumerate(_models(5)):  # node 0 gets two jobs: its job counter moves between them
            cfg = ConfigRecord({"lr": 0.1, **({"job-seq": j} if with_seq else {})})
            msgs.append(grid.create_message(RecordDict({"arrays": model, "config": cfg}), "train",
                                            nodes[j % 3] if j < 4 else nodes[0], "1"))
        replies[batch] = list(grid.send_and_receive(msgs))
        assert len(replies[batch]) == len(msgs)
        assert (grid.batches is not None) == batch and (not batch or grid.batches.jobs == 5)
    for one, many in zip(replies[False], replies[True]):
        assert not one.has_error() and not many.has_error()
        a, b = _arrays(one), _arrays(many)
        assert list(a) == list(b) == list(TinyCNN().state_dict())
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6)
            if vmap is None:
                np.testing.assert_array_equal(a[k], b[k])
        np.testing.assert_allclose(one.content["metrics"]["train_loss"], many.content["metrics"]["train_loss"],
                                   rtol=1e-5)
    start = _models(1)[0]["fc.weight"].numpy()
    assert not np.allclose(_arrays(replies[True][0])["fc.weight"], start)  # it did train


def test_the_helper_is_an_ordinary_clientapp_with_a_batch_entry():
    app = _app()
    entry = batch_entry(app)
    assert entry is not None
    ctx = Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                  run_config={})
    msg = Message(RecordDict({"arrays": _models(1)[0], "config": ConfigRecord({"job-seq": 0})}), 5, "train")
    assert entry.key(msg) == (3, 0.1, "cpu")  # (steps, lr, device): jobs that can share a call
    rep = app(msg, ctx)  # Flower's way in: one message
    assert not rep.has_error() and list(_arrays(rep)) == list(TinyCNN().state_dict())


class DropoutCNN(TinyCNN):
    def forward(self, x):
        return self.fc(F.dropout(torch.flatten(F.max_pool2d(F.relu(self.conv(x)), 2), 1), 0.5, self.training))


def _one_job_each(app, batch: bool, seqs=(0, 1, 2), model: ArrayRecord | None = None) -> list[Message]:
    """One job per node of a new 3-node Grid (``seqs``: their ``job-seq``; None: none sent, each node
    counts its jobs), a fourth to the first node: the replies, in order."""
    grid = InProcessGrid(app, 3, batch=batch, ahead=False)
    model = model if model is not None else _models(1)[0]
    nodes = list(grid.get_node_ids())
    cfgs = [ConfigRecord({"job-seq": j}) for j in seqs] if seqs is not None else [ConfigRecord() for _ in nodes]
    msgs = [grid.create_message(RecordDict({"arrays": model, "config": c}), "train", n, "1")
            for c, n in zip([*cfgs, cfgs[0]], [*nodes, nodes[0]])]
    return list(grid.send_and_receive(msgs))


@pytest.mark.parametrize("with_seq", [True, False])
@pytest.mark.parametrize("vmap", [True, None])
def test_dropout_gives_each_job_the_same_reply_on_every_run_and_leaves_torchs_generator_alone(vmap, with_seq,
                                                                                            caplog):
    """Dropout draws from a seed of the job's own: the same jobs give the same bits twice, batched or
    not, and torch's global generator is where it was. Before, dropout drew from torch's global
    generator: two runs of the same seed gave other replies. With ``vmap`` the batch call meets the
    random op, says so once and trains its jobs one after the other, with the job numbers it read
    (without ``job-seq`` a node counts its jobs: the call must not count them twice)."""
    import logging

    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    app = torch_client_app(DropoutCNN, F.cross_entropy, tiny_data, batch_size=8, local_steps=3, lr=0.1, vmap=vmap)
    model = _models(1)[0]
    torch.manual_seed(123)
    state = torch.get_rng_state()
    seqs = (0, 1, 2) if with_seq else None
    first = _one_job_each(app, batch=False, model=model, seqs=seqs)
    assert torch.equal(torch.get_rng_state(), state)
    for again in (_one_job_each(app, batch=False, seqs=seqs), _one_job_each(app, batch=True, seqs=seqs)):
        for a, b in zip(first, again):
            assert not a.has_error() and not b.has_error()
            for k, v in _arrays(a).items():
                np.testing.assert_array_equal(v, _arrays(b)[k])
    said = [r.getMessage() for r in caplog.records if "draws random numbers" in r.getMessage()]
    assert len(said) == (1 if vmap else 0), said
    # (another job number on the same node and model: another reply, its own minibatches and masks)
    other = _one_job_each(app, False, (5, 1, 2), model=model)[0]
    assert not np.array_equal(_arrays(first[0])["fc.weight"], _arrays(other)["fc.weight"])


def test_a_batch_call_that_fails_does_not_count_its_jobs_twice():
    """Without ``job-seq`` a node counts its jobs. A batch call with one bad job (arrays of another
    shape) raises and the Grid redoes its jobs one by one: the good jobs get the numbers, and so the
    replies, they get unbatched (before, the failed call had counted them already), the bad one its
    own error."""
    def jobs(grid):
        nodes = list(grid.get_node_ids())
        bad = ArrayRecord({k: torch.zeros(2, 2) for k in TinyCNN().state_dict()})
        models = [_models(1)[0], bad, _models(1)[0], _models(1)[0]]
        return [grid.create_message(RecordDict({"arrays": m, "config": ConfigRecord()}), "train", n, "1")
                for m, n in zip(models, [*nodes, nodes[0]])]

    replies = {}
    for batch in (False, True):
        grid = InProcessGrid(_app(), 3, batch=batch, ahead=False)
        replies[batch] = list(grid.send_and_receive(jobs(grid)))
    assert [r.has_error() for r in replies[True]] == [r.has_error() for r in replies[False]] == [False, True, False,
                                                                                                 False]
    for one, many in zip(replies[False], replies[True]):
        if not one.has_error():
            for k, v in _arrays(one).items():
                np.testing.assert_array_equal(v, _arrays(many)[k])


def test_the_helpers_options_are_checked_and_numpy_data_is_taken():
    """A minibatch of 0 rows, no local step or a learning rate that is not a positive number is refused
    when the app is built (before, a job trained on nothing and replied NaN); ``data_fn`` may return
    numpy arrays (as ``flwr-datasets`` with the numpy format gives them), not only tensors."""
    for bad in (dict(batch_size=0), dict(batch_size=2.5), dict(batch_size=True), dict(local_steps=0),
                dict(lr=0.0), dict(lr=float("nan")), dict(lr=float("inf")), dict(lr="0.1"), dict(lr=True)):
        with pytest.raises(ValueError, match="must be a positive"):
            torch_client_app(TinyCNN, F.cross_entropy, tiny_data, **bad)
    app = torch_client_app(TinyCNN, F.cross_entropy, lambda c: tuple(t.numpy() for t in tiny_data(c)),
                           batch_size=np.int64(8), local_steps=3, lr=np.float32(0.1))
    reference = _app()
    msg = Message(RecordDict({"arrays": _models(1)[0], "config": ConfigRecord({"job-seq": 0})}), 5, "train")
    ctx = Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                  run_config={})
    got, want = app(msg, ctx), reference(msg, ctx)
    assert not got.has_error()
    for k, v in _arrays(want).items():
        np.testing.assert_allclose(_arrays(got)[k], v, rtol=1e-6, atol=1e-7)


def test_a_model_with_running_statistics_is_refused_with_the_reason():
    """BatchNorm keeps running statistics this helper does not train (replies carry the buffers as
    received): every job fails with the reason, instead of a model whose statistics never move."""

    class WithNorm(TinyCNN):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm2d(3)

        def forward(self, x):
            return self.fc(torch.flatten(F.max_pool2d(F.relu(self.norm(self.conv(x))), 2), 1))

    app = torch_client_app(WithNorm, F.cross_entropy, tiny_data, batch_size=8)
    grid = InProcessGrid(app, 1, batch=False)
    torch.manual_seed(0)
    msg = grid.create_message(RecordDict({"arrays": ArrayRecord(WithNorm().state_dict()),
                                          "config": ConfigRecord({"job-seq": 0})}), "train",
                              next(iter(grid.get_node_ids())), "1")
    (rep,) = grid.send_and_receive([msg])
    assert rep.has_error()
    assert "module 'norm' (BatchNorm2d) keeps running statistics" in rep.error.reason
    assert "track_running_stats=False" in rep.error.reason
    from fl_rescaled.torch_batch import _Helper

    def without_statistics():  # (the same norm layer, built without running statistics: taken)
        return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3, track_running_stats=False))

    helper = _Helper(without_statistics, F.cross_entropy, tiny_data, 8, 1, 0.1, 0, "cpu", "arrays", None)
    assert isinstance(helper.model("cpu"), nn.Sequential)
    with pytest.raises(ValueError, match=r"module '1' \(BatchNorm1d\) keeps running statistics"):
        _Helper(lambda: nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)), F.cross_entropy, tiny_data, 8, 1, 0.1, 0,
                "cpu", "arrays", None).model("cpu")


@pytest.mark.mnist
def test_the_examples_batched_app_runs_in_process_and_matches_its_unbatched_replies(monkeypatch, mnist_cache):
    """examples/quickstart-async's ``batched_app`` (its CNN through the helper) with FedBuff in process, and
    three of its jobs answered in one batch against one by one."""
    from pathlib import Path

    from fl_rescaled import run_inprocess

    example_dir = Path(__file__).resolve().parents[1] / "examples" / "quickstart-async"
    monkeypatch.syspath_prepend(str(example_dir))
    import importlib

    server_app = importlib.import_module("quickstart_async.server_app")
    batched_app = importlib.import_module("quickstart_async.batched_app")
    results = []
    monkeypatch.setattr(server_app, "report", lambda name, initial, result: results.append(result))
    torch.set_num_threads(1)
    config = {"strategy": "fedbuff", "num-trainings": 4, "examples-per-client": 60, "fraction-evaluate": 0.0,
              "central-examples": 0}
    run_inprocess(server_app.app, batched_app.app, num_supernodes=4, app_dir=example_dir, run_config=config)
    assert results and results[-1].books["replies-accepted"] >= 2

    run_config = {"examples-per-client": 60}
    replies = {}
    model = ArrayRecord(importlib.import_module("quickstart_async.task").Net().state_dict())
    for batch in (False, True):
        grid = InProcessGrid(batched_app.app, 3, run_config=run_config, batch=batch)
        msgs = [grid.create_message(RecordDict({"arrays": model, "config": ConfigRecord({"lr": 0.05, "job-seq": j})}),
                                    "train", n, "1") for j, n in enumerate(grid.get_node_ids())]
        replies[batch] = list(grid.pull_messages(list(grid.push_messages(msgs))))
    for one, many in zip(replies[False], replies[True]):
        a, b = _arrays(one), _arrays(many)
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5)
