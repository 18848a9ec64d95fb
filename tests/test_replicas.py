"""Batched replicas: runs that share an event order computed in one event loop must give each run's
own trajectory, and a replica that diverges must not touch the others."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from fl_rescaled.experiment import RunSpec, run, run_batch
from fl_rescaled.errors import RejectedReply
from fl_rescaled.layout import ModelLayout, encode_array
from fl_rescaled.manager import zero_nonfinite_replicas
from fl_rescaled.layout import read_reply


def _reply(vec: np.ndarray) -> Message:
    from fl_rescaled.clients.client_app import app
    from fl_rescaled.grid import InProcessGrid

    InProcessGrid(app, 1)  # a run context, which Flower needs to build a Message
    content = RecordDict({"arrays": ArrayRecord({"model": encode_array(vec.astype(np.float32))}),
                          "metrics": MetricRecord({"loss": 0.0})})
    return Message(content, 1, "train")


def test_nonfinite_replica_is_zeroed_and_named_not_the_whole_reply():
    vec = np.arange(12, dtype=np.float32)
    vec[5] = np.nan  # replica 1 of 3 (4 values each)
    out, bad = zero_nonfinite_replicas(vec, 3)
    assert bad == [1]
    assert np.all(out[4:8] == 0)
    np.testing.assert_array_equal(out[:4], vec[:4])
    np.testing.assert_array_equal(out[8:], vec[8:])
    assert np.isnan(vec[5])  # a copy: the reply itself is untouched
    layout = ModelLayout.of(ArrayRecord({"model": Array(np.zeros(12, np.float32))}))[0]
    with pytest.raises(RejectedReply) as exc:  # a single run still rejects the reply
        read_reply(_reply(vec), layout)
    assert exc.value.reason == "non-finite"
    vec[5] = 1.0
    out, bad = zero_nonfinite_replicas(vec, 3)
    assert bad == [] and out is vec


def test_random_compute_times_need_one_seed_per_batch():
    spec = RunSpec(task="mnist", strategy="rescaled", delays="exponential", budget=10)
    with pytest.raises(ValueError, match="share the seed"):
        run_batch(spec, [0.1, 1.0], [0, 1])
    with pytest.raises(ValueError, match="one seed per"):
        run_batch(RunSpec(task="mnist", budget=10), [0.1, 1.0], [0])
    with pytest.raises(ValueError, match="mnist"):
        run_batch(RunSpec(task="quadratic", budget=10), [0.1], [0])


def test_gradient_buffers_start_on_the_promised_boundary():
    """``aligned_empty`` and ``scratch`` (what every gradient is computed into) start on an
    ``ALIGN``-byte boundary, and ALIGN is a whole cache line (64 bytes), as ``tasks.base`` promises."""
    from fl_rescaled.tasks import ALIGN, aligned_empty, scratch

    assert ALIGN == 64
    for size in (1, 3, 17, 1000, 101_770):
        for dtype in (np.float32, np.float64):
            assert aligned_empty(size, dtype).ctypes.data % ALIGN == 0, (size, dtype)
        assert scratch(f"alignment-test-{size}", size).ctypes.data % ALIGN == 0, size


class MatrixProducts:
    """Records every matrix product torch runs: the calls whose BLAS kernel, and so whose summation
    order, depends on the CPU family, on the number of threads and (with several threads) on how
    the buffers are aligned. An operand's address is recorded modulo 16 bytes (what numpy and a
    message's bytes guarantee), a buffer written with ``out=`` modulo ``ALIGN`` (64: what the
    gradient buffers, ``scratch``, guarantee)."""

    OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear")

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        from fl_rescaled.tasks import ALIGN

        calls = self.calls = []
        ops = self.OPS

        def where(tensors, modulo):
            return tuple((tuple(a.shape), a.stride(), a.data_ptr() % modulo) for a in tensors
                         if isinstance(a, torch.Tensor))

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name in ops:  # operands, then out=: shape, strides, address modulo 16 / ALIGN bytes
                    calls.append((name, where(args, 16), where((kwargs or {}).values(), ALIGN)))
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


@pytest.mark.mnist
@pytest.mark.parametrize("seeds", [[0, 0, 0], [0, 1, 2]])
def test_a_batched_job_issues_exactly_the_single_runs_matrix_products(mnist_cache, seeds, monkeypatch):
    """What makes replicas bit-identical to their single runs on every CPU: each replica's gradient
    and evaluation hand the BLAS the same products (shapes, strides, alignment, order) as a single
    run. Whatever kernel a CPU picks for a product, both paths then get the same one. (The operands
    a product reads are compared modulo 16 bytes only: a single run's weights are the message's bytes
    or a numpy array, 16-byte aligned, while a replica's are copied into a 64-byte ``scratch``
    buffer; modulo 64 they differ, 16 against 0.)"""
    from fl_rescaled.tasks import get_task, job_rng, scratch
    from fl_rescaled.tasks.mnist import onednn

    onednn()  # (decided once per process, with a small probe product: before any is recorded)
    base = {"task": "mnist", "seed": 0, "num-partitions": 10, "batch-size": 64}
    single = get_task(base)
    batched = get_task({**base, "replica-seeds": seeds})
    x1 = single.initial_params(0)
    with MatrixProducts() as one:  # as the ClientApp calls it
        single.gradient(x1, 3, job_rng(single, 3, 0), out=scratch("gradient", single.size))
    with MatrixProducts() as many:
        batched.gradient(batched.initial_params(), 3, job_rng(batched, 3, 0), out=scratch("gradient", batched.size))
    assert one.calls and many.calls == one.calls * len(seeds)
    # A dispatch mode sees its own thread's ops: the evaluations here on this thread, as on one core
    # (spread over threads, each partition's ops are the same: tests/test_tasks.py).
    monkeypatch.setattr("fl_rescaled.tasks.mnist.available_cores", lambda: 1)
    with MatrixProducts() as one:
        single.evaluate(x1)
    with MatrixProducts() as many:
        batched.evaluate(batched.initial_params())
    assert one.calls and many.calls == one.calls * len(seeds)


def _single(method: str, delays: str, lr: float, seed: int) -> dict:
    """The single run a replica follows: without the median clip, as a batch (which applies no bound;
    the paper study's single runs turn it off too)."""
    return run(RunSpec(task="mnist", strategy=method, delays=delays, budget=40, eval_every=20, lr=lr, seed=seed,
                       options={"clip_factor": None}))


@pytest.mark.mnist
@pytest.mark.parametrize("method,delays,lrs,seeds", [
    ("rescaled", "fixed", [0.1, 1.0, 3.0], [0, 0, 1]),  # α and seed both vary under fixed τ
    ("malenia", "fixed", [0.1, 1.0], [2, 2]),  # a method with per-worker gradient memory
    ("ringleader", "exponential", [0.3, 1.0], [3, 3]),  # random times: one seed, several α
])
def test_each_replica_follows_its_own_run_bit_for_bit(mnist_cache, method, delays, lrs, seeds):
    spec = RunSpec(task="mnist", strategy=method, delays=delays, budget=40, eval_every=20)
    outs = run_batch(spec, lrs, seeds)
    assert len(outs) == len(lrs)
    for out, lr, seed in zip(outs, lrs, seeds):
        single = _single(method, delays, lr, seed)
        assert (out["lr"], out["seed"]) == (lr, seed)
        # Same events, same minibatches, same rounding of every step: the same final model bits.
        np.testing.assert_array_equal(out["final_model"], single["final_model"])
        assert out["num_updates"] == single["num_updates"]
        assert out["gradients"] == single["gradients"]
        assert out["cumulative_stepsize"] == pytest.approx(single["cumulative_stepsize"], rel=1e-12)
        # Each replica is evaluated by the single run's kernels: the same numbers, not merely close ones.
        assert out["final_loss"] == single["final_loss"]
        assert out["client_losses"] == single["client_losses"]
        assert [h["time"] for h in out["history"]] == [h["time"] for h in single["history"]]
        assert [h["loss"] for h in out["history"]] == [h["loss"] for h in single["history"]]
    assert outs[0]["final_loss"] != outs[1]["final_loss"]


@pytest.mark.mnist
def test_a_diverging_replica_is_frozen_and_the_others_are_untouched(mnist_cache):
    spec = RunSpec(task="mnist", strategy="rescaled", budget=40, eval_every=20)
    good, bad = run_batch(spec, [1.0, 1e9], [0, 0])
    single = _single("rescaled", "fixed", 1.0, 0)
    np.testing.assert_array_equal(good["final_model"], single["final_model"])
    assert good["rejected"] == {} and "frozen_at" not in good
    assert bad["rejected"].get("non-finite") == 1
    assert 0 < bad["frozen_at"] <= 40
    assert np.isfinite(bad["final_model"]).all()  # a non-finite gradient never reached its model


@pytest.mark.mnist
def test_a_rerun_after_a_freeze_starts_with_every_replica_moving(mnist_cache):
    from fl_rescaled.experiment import _start, make_strategy
    from fl_rescaled.tasks import get_task

    spec = RunSpec(task="mnist", strategy="rescaled", budget=40, eval_every=20).resolved()
    cfg = {**spec.task_config(), "replica-seeds": [0, 0]}
    task = get_task(cfg)
    strategy = make_strategy(dataclasses.replace(spec, lr=1.0))
    driver, _ = _start(spec, cfg, task, strategy, task.initial_params(), replicas=[1.0, 1e9])
    first, frozen = driver.x.copy(), dict(driver.state.frozen)
    assert list(frozen) == [1]
    again, _ = _start(spec, cfg, task, strategy, task.initial_params(), replicas=[1.0, 1e9])
    # The second run applies replica 1's α again until it diverges at the same event.
    assert again.state.frozen == frozen
    np.testing.assert_array_equal(again.x, first)
