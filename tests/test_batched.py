"""Lazy batches of jobs in flight (``fl_rescaled.grid_batch``) and batched ClientApps
(``fl_rescaled.batching``, ``fl_rescaled.torch_batch``): the same results as one job at a time, within
float tolerance, and the same bits for any number of threads."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from conftest import quad
from fl_rescaled import InProcessGrid
from fl_rescaled.batching import BatchedClientApp, batch_entry, plan_chunks
from fl_rescaled.experiment import RunSpec, run


def close_runs(a: dict, b: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """The same events and results; values equal up to float rounding."""
    assert a["num_updates"] == b["num_updates"] and a["updates_per_worker"] == b["updates_per_worker"]
    assert a["rejected"] == b["rejected"] and a["discarded_per_worker"] == b["discarded_per_worker"]
    assert [h["time"] for h in a["history"]] == [h["time"] for h in b["history"]]
    np.testing.assert_allclose(a["final_model"], b["final_model"], rtol=rtol, atol=atol)
    np.testing.assert_allclose([h["loss"] for h in a["history"]], [h["loss"] for h in b["history"]], rtol=rtol)


def same_bits(a: dict, b: dict) -> None:
    assert a["num_updates"] == b["num_updates"] and a["updates_per_worker"] == b["updates_per_worker"]
    np.testing.assert_array_equal(a["final_model"], b["final_model"])
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]


def test_chunks_cover_the_batch_in_near_equal_calls_whatever_the_threads():
    assert plan_chunks(0, 8) == []
    assert [s.stop - s.start for s in plan_chunks(10, 8)] == [5, 5]
    assert [s.stop - s.start for s in plan_chunks(17, 8)] == [6, 6, 5]
    assert plan_chunks(7, None) == [slice(0, 7)]
    cuts = plan_chunks(100, 8)
    assert cuts[0].start == 0 and cuts[-1].stop == 100 and all(a.stop == b.start for a, b in zip(cuts, cuts[1:]))


@pytest.mark.parametrize("strategy", ["rescaled", "malenia", "fedbuff"])
def test_quadratic_batched_equals_one_by_one(strategy):
    kw = dict(strategy=strategy, taus=[1, 2, 3, 5], quad_a=[1, 2, 1, 3], quad_b=[0, 2, -1, 4], quad_dim=3,
              noise=0.3, lr=0.05, budget=60, eval_every=3, delays="exponential", seed=4)
    one = quad(**kw, no_batch=True)
    batched = [quad(**kw, workers=w) for w in (1, 2, 3)]
    close_runs(one, batched[0], rtol=1e-9, atol=1e-12)
    for other in batched[1:]:
        same_bits(batched[0], other)


def _mnist_spec(**kw) -> RunSpec:
    return RunSpec(task="mnist", strategy="rescaled", budget=20, eval_every=4, lr=1.0, seed=3,
                   delays="exponential", **kw)


@pytest.mark.mnist
def test_mnist_batched_equals_one_by_one_and_its_bits_do_not_depend_on_the_threads(mnist_cache):
    one = run(_mnist_spec(no_batch=True, workers=1))
    batched = [run(_mnist_spec(workers=w)) for w in (1, 2, 3)]
    assert one["num_updates"] > 50
    close_runs(one, batched[0], rtol=1e-3, atol=1e-5)
    for other in batched[1:]:
        same_bits(batched[0], other)


def test_the_mlp_kernel_of_b_jobs_equals_each_job_alone(kernel):
    """``mlp_gradients`` of B jobs against ``mlp_gradient`` job by job: per job with oneDNN (the
    same bits), batched products with torch's BLAS (equal within float rounding)."""
    import torch

    import fl_rescaled.tasks.mnist as mnist
    from fl_rescaled.tasks.batched import mlp_gradients

    rng = np.random.default_rng(5)
    w = torch.from_numpy(np.stack([mnist.MnistTask().initial_params(s) for s in range(3)]))
    xb = torch.from_numpy(rng.standard_normal((3, 64, 784)).astype(np.float32))
    yb = torch.from_numpy(rng.integers(0, 10, (3, 64)))
    g, loss = mlp_gradients(w, xb, yb)
    for j in range(3):
        ref, ref_loss = mnist.mlp_gradient(w[j], xb[j], yb[j])
        if kernel == "onednn":
            np.testing.assert_array_equal(g[j].numpy(), ref)
            assert float(loss[j]) == ref_loss
        else:
            np.testing.assert_allclose(g[j].numpy(), ref, rtol=1e-5, atol=1e-7)
            assert float(loss[j]) == pytest.approx(ref_loss, rel=1e-6)


def test_the_mlp_kernels_write_the_gradients_over_their_models_with_the_same_bits(kernel):
    """The worker process writes each job's gradient over the model it was sent (``out`` = ``w``), and
    the in-process batches (``mnist_jobs``) over their stacked models, rows not padded: ``mlp_gradients``
    (B = 1 and 3) and ``mlp_gradient`` give the bits and losses they give into a buffer of their own
    (of the same layout: with several threads a product's last bit may follow its output's address).
    (They used to write a layer's gradient before reading that layer's weights for the backward pass:
    in place, the hidden layer's gradient came out wrong.)"""
    import torch

    import fl_rescaled.tasks.mnist as mnist
    from fl_rescaled.tasks.base import aligned_empty
    from fl_rescaled.tasks.batched import mlp_gradients

    rng = np.random.default_rng(6)
    w = np.stack([mnist.MnistTask().initial_params(s) for s in range(3)])
    xb = torch.from_numpy(rng.standard_normal((3, 64, 784)).astype(np.float32))
    yb = torch.from_numpy(rng.integers(0, 10, (3, 64)))

    def aligned(rows: np.ndarray) -> torch.Tensor:  # (each row padded to start 64-byte aligned, as the slots)
        padded = -(-rows.shape[1] // 16) * 16
        buf = aligned_empty(rows.shape[0] * padded).reshape(rows.shape[0], padded)[:, :rows.shape[1]]
        buf[...] = rows
        assert all(buf[j].ctypes.data % 64 == 0 for j in range(rows.shape[0]))
        return torch.from_numpy(buf)

    for B in (1, 3):
        ref, ref_loss = mlp_gradients(aligned(w[:B]), xb[:B], yb[:B], out=aligned(np.zeros_like(w[:B])))
        model = aligned(w[:B])
        got, loss = mlp_gradients(model, xb[:B], yb[:B], out=model)
        assert got.data_ptr() == model.data_ptr() and torch.equal(got, ref) and torch.equal(loss, ref_loss)
        assert not np.array_equal(got.numpy(), w[:B])  # (the models are gone: the gradients took their place)
        fresh, fresh_loss = mlp_gradients(torch.from_numpy(w[:B].copy()), xb[:B], yb[:B])  # (into torch.empty)
        stacked = torch.empty(w[:B].shape)  # (as ``mnist_jobs`` stacks them: torch's 64-byte aligned buffer)
        stacked.copy_(torch.from_numpy(w[:B]))
        got, loss = mlp_gradients(stacked, xb[:B], yb[:B], out=stacked)
        assert torch.equal(got, fresh) and torch.equal(loss, fresh_loss)
    for j in range(3):
        ref, ref_loss = mnist.mlp_gradient(aligned(w[j:j + 1])[0], xb[j], yb[j], aligned(np.zeros_like(w[j:j + 1]))[0])
        model = aligned(w[j:j + 1])[0]
        got, loss = mnist.mlp_gradient(model, xb[j], yb[j], model)
        np.testing.assert_array_equal(got, ref)
        assert loss == ref_loss


def test_one_job_as_the_worker_computes_it_equals_the_batched_kernel(kernel):
    """``rows_job`` (the worker process's job, and a job the loop steals) gives the bits and the loss of
    ``mlp_gradients`` on the same rows, into a buffer of its own and over the model as the worker writes
    it (with oneDNN it calls the one-job kernel directly, as ``mlp_gradients`` does for each job)."""
    import torch

    import fl_rescaled.tasks.mnist as mnist
    from fl_rescaled.tasks.base import aligned_empty
    from fl_rescaled.tasks.batched import mlp_gradients, rows_job

    rng = np.random.default_rng(7)
    X = torch.from_numpy(rng.standard_normal((300, 784)).astype(np.float32))
    Y = torch.from_numpy(rng.integers(0, 10, 300))
    rows = torch.from_numpy(rng.choice(300, (1, 64), replace=False))
    w = mnist.MnistTask().initial_params(3)
    ref, ref_loss = mlp_gradients(torch.from_numpy(w.copy()).view(1, -1), X[rows[0]].view(1, 64, -1),
                                  Y[rows[0]].view(1, 64))
    got, loss = rows_job(X, Y, torch.from_numpy(w.copy()).view(1, -1), rows, 64, 0, 0.0, 0.0)
    assert got.shape == (1, w.size) and torch.equal(got, ref) and loss == float(ref_loss[0])
    slot = torch.from_numpy(aligned_empty(w.size)).view(1, -1)  # (a worker's slot: the model, then its gradient)
    slot.copy_(torch.from_numpy(w).view(1, -1))
    got, loss = rows_job(X, Y, slot, rows, 64, 0, 0.0, 0.0, out=slot)
    assert got.data_ptr() == slot.data_ptr() and torch.equal(slot, ref) and loss == float(ref_loss[0])


@pytest.mark.mnist
def test_mnist_local_training_batched_equals_one_by_one(mnist_cache):
    kw = dict(task="mnist", strategy="fedbuff", budget=8, eval_every=4, seed=1, local_steps=3)
    one = run(RunSpec(**kw, no_batch=True))
    batched = run(RunSpec(**kw, workers=2))
    close_runs(one, batched, rtol=1e-3, atol=1e-5)


# -- the Grid with apps that batch, apps that do not, and batches that fail

def _job(grid: InProcessGrid, node: int, value: float, kind: str = "train") -> Message:
    content = RecordDict({"arrays": ArrayRecord({"x": Array(np.full(3, value))}), "config": ConfigRecord({"k": 1})})
    return grid.create_message(content, kind, node, "0")


def _double(msg: Message, context: Context) -> Message:
    x = msg.content["arrays"]["x"].numpy()
    return Message(RecordDict({"arrays": ArrayRecord({"x": Array(2 * x)}),
                               "metrics": MetricRecord({"p": context.node_config["partition-id"]})}), reply_to=msg)


def _doubling_app(calls: list[int], fail: bool = False) -> BatchedClientApp:
    app = BatchedClientApp()
    app.train()(_double)

    @app.batch(key=lambda m: "train" if m.metadata.message_type == "train" else None, chunk=3)
    def many(msgs, contexts):
        calls.append(len(msgs))
        if fail:
            raise RuntimeError("batch broke")
        return [_double(m, c) for m, c in zip(msgs, contexts)]

    return app


def _values(replies: list[Message]) -> list[float]:
    return [float(r.content["arrays"]["x"].numpy()[0]) for r in replies]


@pytest.mark.parametrize("workers", [1, 2])
def test_the_grid_answers_pending_jobs_in_one_batch_when_one_is_pulled(workers):
    calls: list[int] = []
    grid = InProcessGrid(_doubling_app(calls), 4, workers=workers)
    nodes = list(grid.get_node_ids())
    ids = list(grid.push_messages([_job(grid, nodes[i % 4], float(i)) for i in range(7)]))
    grid.discard_messages([ids[6]])
    assert calls == []  # lazy: nothing computed before a reply is needed
    assert _values(list(grid.pull_messages([ids[2]]))) == [4.0]
    assert calls == [3, 3]  # the six pending jobs, in ⌈6/3⌉ calls
    assert _values(list(grid.pull_messages(ids))) == [0.0, 2.0, 6.0, 8.0, 10.0]
    assert grid.batches.formed == 1 and grid.batches.calls == 2 and grid.batches.jobs == 6
    grid.close()


def test_a_failing_batch_and_unbatchable_messages_go_one_by_one():
    calls: list[int] = []
    grid = InProcessGrid(_doubling_app(calls, fail=True), 2)
    n0, n1 = grid.get_node_ids()
    ids = list(grid.push_messages([_job(grid, n0, 1.0), _job(grid, n1, 2.0), _job(grid, n0, 3.0, "evaluate")]))
    replies = list(grid.pull_messages(ids))
    assert calls == [2]  # the evaluate message had no key: never in a batch
    assert [r.has_error() for r in replies] == [False, False, True]  # (the app registers no evaluate)
    assert _values(replies[:2]) == [2.0, 4.0]


def test_a_plain_clientapp_runs_one_by_one_and_an_offline_node_is_unavailable():
    app = ClientApp()
    app.train()(_double)
    assert batch_entry(app) is None
    grid = InProcessGrid(app, 2)
    assert grid.batches is None
    calls: list[int] = []
    grid = InProcessGrid(_doubling_app(calls), 3)
    n0, n1, n2 = grid.get_node_ids()
    ids = list(grid.push_messages([_job(grid, n, 1.0) for n in (n0, n1, n2)]))
    grid.set_online(n1, False)
    first = list(grid.pull_messages([ids[0]]))
    assert calls == [2]  # n1 is down: not in the batch
    grid.set_online(n2, False)  # down after its reply was computed: unavailable when pulled
    rest = list(grid.pull_messages(ids[1:]))
    assert not first[0].has_error() and all(r.has_error() for r in rest)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_job_pushed_unread_is_computed_only_if_pulled_and_then_alone(workers):
    calls: list[int] = []
    grid = InProcessGrid(_doubling_app(calls), 4, workers=workers)
    nodes = list(grid.get_node_ids())
    ids = list(grid.push_messages([_job(grid, nodes[i], float(i)) for i in range(3)]))
    unread = list(grid.push_unread([_job(grid, nodes[3], 7.0), _job(grid, nodes[3], 8.0)]))
    assert _values(list(grid.pull_messages([ids[0]]))) == [0.0]
    assert calls == [3]  # the three read jobs; neither unread one joined their batch
    grid.discard_messages([unread[0]])  # (its client went offline before it ended: never computed)
    assert _values(list(grid.pull_messages([unread[1]]))) == [16.0]  # (pulled after all: computed, alone)
    assert calls == [3, 1] and grid.batches.jobs == 4
    assert list(grid.pull_messages([unread[0]])) == []
    grid.close()
    # A ClientApp with no batch entry, its jobs computed ahead on the pool: an unread job is not.
    seen: list[float] = []
    app = ClientApp()

    @app.train()
    def counted(msg: Message, context: Context) -> Message:
        seen.append(float(msg.content["arrays"]["x"].numpy()[0]))
        return _double(msg, context)

    grid = InProcessGrid(app, 2, workers=workers)
    n0, n1 = grid.get_node_ids()
    (read,) = grid.push_messages([_job(grid, n0, 1.0)])
    dropped, kept = grid.push_unread([_job(grid, n1, 2.0), _job(grid, n1, 3.0)])
    grid.wait_messages([read, dropped, kept])
    assert _values(list(grid.pull_messages([read, kept]))) == [2.0, 6.0]
    grid.discard_messages([dropped])
    grid.close()  # (waits for the pool: whatever was started ahead is done)
    assert sorted(seen) == [1.0, 3.0]


@pytest.mark.parametrize("workers", [1, 2])
def test_jobs_whose_replies_the_clock_will_not_read_are_never_computed(monkeypatch, workers):
    """A job whose client goes offline before it ends (``offline``), or that ends after the budget,
    is pushed unread: with clients that come and go, the run computes exactly the replies it reads,
    and its trajectory is the one of a Grid that computes every job (no ``push_unread``)."""
    from fl_rescaled.grid_batch import LazyBatches

    computed: list[str] = []
    call = LazyBatches._call

    def counting(self, msgs, contexts):
        computed.extend(m.metadata.message_id for m in msgs)
        return call(self, msgs, contexts)

    monkeypatch.setattr(LazyBatches, "_call", counting)
    kw = dict(task="quadratic", strategy="rescaled", num_clients=30, options={"concurrency": 6}, lr=0.05,
              budget=150, delays="lognormal", availability="daily", availability_period=30, seed=7, noise=0.2,
              quad_dim=2, workers=workers)
    hinted = run(RunSpec(**kw))
    read = hinted["num_updates"]
    assert hinted["rejected"]["offline"] > 10 and sorted(hinted["rejected"]) == ["offline"]
    assert len(computed) == len(set(computed)) == read
    computed.clear()
    monkeypatch.delattr(InProcessGrid, "push_unread")
    every = run(RunSpec(**kw))
    same_bits(hinted, every)
    assert hinted["rejected"] == every["rejected"] and hinted["final_params"] == every["final_params"]
    assert len(computed) > read + 10  # (the jobs lost offline and those in flight at the end)
