"""MNIST gradients in a worker process (``fl_rescaled.tasks.kernel_process``): with ``--workers`` ≥ 2
the in-process Grid sends each CPU MNIST gradient job there when it is pushed; the run's bits are those
of ``--workers 1``, and a worker that dies, fails or cannot start leaves the jobs to the process."""

from __future__ import annotations

import json
import logging
import os
import signal

import numpy as np
import pytest
import torch

import fl_rescaled.tasks.kernel_process as kp
from fl_rescaled.experiment import RunSpec, run
from fl_rescaled.tasks import client_rng, get_task, mlp_gradient, task_spec
from fl_rescaled.tasks.batched import device_data, minibatch_rows, rows_job

pytestmark = pytest.mark.mnist


@pytest.fixture(autouse=True)
def _one_worker_process(monkeypatch):
    """One worker per task, whatever this machine's cores (two where three are free: tested on its own)."""
    monkeypatch.setattr(kp, "PROCESSES", 1)


def _spec(seed: int, **kw) -> RunSpec:
    return RunSpec(**{"task": "mnist", "strategy": "rescaled", "budget": 20, "eval_every": 10, "lr": 1.0,
                      "seed": seed, "delays": "exponential", **kw})


def _same_bits(a: dict, b: dict) -> None:
    assert a["num_updates"] == b["num_updates"] > 50
    assert a["updates_per_worker"] == b["updates_per_worker"]
    np.testing.assert_array_equal(a["final_model"], b["final_model"])
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]


def _own_worker(seed: int, slots: int):
    """A 10-client MNIST task of ``seed``, its data as the worker lays it out, and a worker of its own
    with ``slots`` slots (the caller closes it)."""
    cfg = {"task": "mnist", "seed": seed, "num-partitions": 10, "batch-size": 64, "dirichlet-alpha": 0.0}
    task = get_task(cfg)
    return task, device_data(task, "cpu"), kp.KernelProcess(task_spec(cfg), task.size, task.batch_size, slots=slots)


def _worker(seed: int) -> kp.KernelProcess | None:
    """The worker of the run with this seed (the task spec a job carries names it)."""
    found = [pool for spec, pool in kp._WORKERS.items() if json.loads(spec).get("seed") == seed]
    assert len(found) <= 1 and all(len(pool) <= kp.PROCESSES for pool in found)
    return found[0][0] if found and found[0] else None


def _stand_in_python(tmp_path, script: str) -> str:
    """An executable, for ``sys.executable``, that runs ``script`` (a stand-in worker) with the worker's
    arguments."""
    import stat
    import sys

    fake = tmp_path / "stand_in_worker.py"
    fake.write_text(script)
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {fake} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_the_worker_answers_the_jobs_with_the_bits_of_one_process(mnist_cache):
    one = run(_spec(11, workers=1))
    two = run(_spec(11, workers=2))
    _same_bits(one, two)
    worker = _worker(11)
    assert worker is not None and not worker.broken
    # every applied gradient came from the worker, or from this process where it had not started the job
    # (which of the two computes a job depends on timing: a fresh worker's first jobs may all be stolen)
    assert worker.answered + worker.stolen >= two["num_updates"]
    # the malenia strategy cancels jobs: their slots come back
    m1, m2 = (run(_spec(12, strategy="malenia", budget=80, eval_every=40, workers=w)) for w in (1, 2))
    assert m1["num_updates"] > 0
    np.testing.assert_array_equal(m1["final_model"], m2["final_model"])


def test_two_workers_share_the_jobs_with_the_same_bits(mnist_cache, monkeypatch):
    """With ``PROCESSES`` = 2 (three cores or more) each job goes to the less busy worker: both compute
    jobs, and the run ends on the bits of ``--workers 1``; a broken one is replaced by a third."""
    one = run(_spec(23, workers=1))
    kp.close_all()
    monkeypatch.setattr(kp, "PROCESSES", 2)
    two = run(_spec(23, workers=2))
    _same_bits(one, two)
    (pool,) = [p for spec, p in kp._WORKERS.items() if json.loads(spec).get("seed") == 23]
    assert len(pool) == 2 and pool[0] is not pool[1] and all(not w.broken for w in pool)
    assert all(w.answered > 0 for w in pool)  # (each took jobs: the least busy one gets the next)
    assert sum(w.answered + w.stolen for w in pool) >= two["num_updates"]
    first, second = pool
    first._break("killed by the test")
    again = run(_spec(23, workers=2))
    _same_bits(one, again)
    (now,) = kp._WORKERS.values()
    assert len(now) == 2 and first not in now and second in now and all(w.answered > 0 for w in now)


def test_a_worker_that_dies_mid_run_changes_nothing(mnist_cache, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    one = run(_spec(13, workers=1))
    sent, killed = [], []
    submit = kp.KernelProcess.submit

    def submit_then_die(self, *args, **kw):
        slot = submit(self, *args, **kw)
        sent.append(slot)
        if len(sent) == 40:
            self._proc.kill()  # the jobs it holds are computed in process; a new worker takes the next
            self._proc.wait(timeout=10)  # (dead: a killed 1 GB process keeps its pipes open while it unmaps)
            killed.append(self)
        return slot

    monkeypatch.setattr(kp.KernelProcess, "submit", submit_then_die)
    two = run(_spec(13, workers=2))
    _same_bits(one, two)
    assert len(sent) > 40
    said = [r.getMessage() for r in caplog.records if "worker process stopped" in r.getMessage()]
    assert len(said) == 1 and "run in this process, with the same results" in said[0]
    new = _worker(13)  # a new worker took the jobs after it (computed there, or stolen when wanted first)
    assert new is not None and new is not killed[0] and not new.broken and new.answered + new.stolen > 0


def test_the_worker_runs_the_callers_package_not_one_in_the_working_folder(mnist_cache, tmp_path, monkeypatch):
    """Run from a folder that holds another ``fl_rescaled`` (a source checkout beside an installed
    release, another version): the worker imports the caller's package, not that one (``python -P``).
    Before, ``-m`` put the working folder first, and a worker started there failed (or ran other code)."""
    shadow = tmp_path / "fl_rescaled"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the working folder\'s fl_rescaled was imported')\n")
    monkeypatch.chdir(tmp_path)
    task, (_, _, starts, sizes), worker = _own_worker(23, slots=2)
    try:
        x = task.initial_params(0)
        rows = minibatch_rows(starts, sizes, [1], [client_rng(23, 1, 4)], 64)[0]
        g, loss = worker.result(worker.submit(x, rows))
        ref, ref_loss = mlp_gradient(torch.from_numpy(x), *task.minibatch(1, client_rng(23, 1, 4)))
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-7)
        assert abs(loss - ref_loss) < 1e-5 and not worker.broken
    finally:
        worker.close()


def test_a_worker_that_cannot_start_says_why_in_the_warning(mnist_cache, tmp_path, monkeypatch, caplog):
    """A worker that fails before it is ready (here: a stand-in that writes a traceback's last line and
    exits) is given up with that line in the error and in the run's WARNING, not only "it died"."""
    monkeypatch.setattr(kp.sys, "executable", _stand_in_python(
        tmp_path, "import sys\nsys.stderr.write('Traceback (most recent call last):\\n  ...\\n"
                  "MemoryError: no room for the training images\\n')\nsys.exit(1)\n"))
    cfg = {"task": "mnist", "seed": 24, "num-partitions": 10, "batch-size": 64, "dirichlet-alpha": 0.0}
    task = get_task(cfg)
    with pytest.raises(kp.KernelProcessError, match="the worker said: MemoryError: no room for the training images"):
        kp.KernelProcess(task_spec(cfg), task.size, task.batch_size, slots=2)
    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    run(_spec(24, workers=2, budget=3))
    said = [r.getMessage() for r in caplog.records if "could not start" in r.getMessage()]
    assert said and all("MemoryError: no room for the training images" in ln for ln in said), said


def test_the_shared_file_is_reserved_and_a_full_filesystem_leaves_the_jobs_in_process(mnist_cache, monkeypatch,
                                                                                      caplog):
    """The worker's shared file has its blocks reserved when it is made: where /dev/shm refuses, the
    temporary folder takes it; where both refuse (no space), the worker does not start, no file is left
    behind and the run ends on the bits of ``--workers 1`` with the reason in the WARNING. (Before, the
    file was sparse: on a filesystem without the room the first write past it killed the run with
    SIGBUS, tried on an 8 MB tmpfs.)"""
    import errno
    import glob
    import tempfile

    real = os.posix_fallocate
    refused = []

    def fallocate(fd, offset, length, *, where=("/dev/shm",)):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if target.startswith(where):
            refused.append(target)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    def ours():
        return set(glob.glob("/dev/shm/fl-rescaled-kernel-*")) | set(
            glob.glob(os.path.join(tempfile.gettempdir(), "fl-rescaled-kernel-*")))

    before = ours()
    monkeypatch.setattr(kp.os, "posix_fallocate", fallocate)
    monkeypatch.setattr(kp, "_room", lambda folder, nbytes: True)  # (/dev/shm tried first on any machine)
    task, _, worker = _own_worker(25, slots=2)  # (/dev/shm refused: the temporary folder took it)
    try:
        x = task.initial_params(0)
        g, loss = worker.result(worker.submit(x, np.arange(64)))
        assert np.isfinite(loss) and not worker.broken
        assert refused or not os.access("/dev/shm", os.W_OK)  # (where there is a /dev/shm, it was refused)
    finally:
        worker.close()
    monkeypatch.setattr(kp.os, "posix_fallocate", lambda fd, o, n: fallocate(fd, o, n, where=("/",)))
    kp.close_all()
    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    _same_bits(run(_spec(25, workers=1)), run(_spec(25, workers=2)))
    said = [r.getMessage() for r in caplog.records if "could not start" in r.getMessage()]
    assert said and all("No space left on device" in ln for ln in said), said
    assert ours() == before  # (every refused file removed)


def test_slots_abandoned_come_back_and_a_full_worker_declines(mnist_cache):
    task, (_, _, starts, sizes), worker = _own_worker(14, slots=2)
    try:
        x = task.initial_params(0)
        rows = [minibatch_rows(starts, sizes, [w], [client_rng(14, w, 1)], 64)[0] for w in range(4)]
        a, b = worker.submit(x, rows[0]), worker.submit(x, rows[1])
        assert worker.submit(x, rows[2]) is None  # both slots taken: that job is left to the process
        worker.abandon(a)
        g, loss = worker.result(b)
        c = worker.submit(x, rows[3])
        assert c is not None
        g3, loss3 = worker.result(c)
        ref, ref_loss = mlp_gradient(torch.from_numpy(x), *task.minibatch(3, client_rng(14, 3, 1)))
        np.testing.assert_allclose(g3, ref, rtol=1e-5, atol=1e-7)
        assert abs(loss3 - ref_loss) < 1e-5
    finally:
        worker.close()
    with pytest.raises(kp.KernelProcessError):
        worker.result(c)


def test_a_job_abandoned_before_the_worker_starts_it_is_never_computed(mnist_cache):
    """At the end of a run the jobs still in flight are abandoned: the worker skips those it has not
    started (their model stays in the slot, never overwritten by a gradient), computes the others,
    and every slot comes back."""
    task, (_, _, starts, sizes), worker = _own_worker(16, slots=4)
    try:
        x = task.initial_params(0)
        rows = [minibatch_rows(starts, sizes, [w], [client_rng(16, w, 1)], 64)[0] for w in range(3)]
        os.kill(worker._proc.pid, signal.SIGSTOP)  # (it starts neither job before the abandon)
        try:
            a, b = worker.submit(x, rows[0]), worker.submit(x, rows[1])
            worker.abandon(b)
        finally:
            os.kill(worker._proc.pid, signal.SIGCONT)
        g, _ = worker.result(a)
        ref, _ = mlp_gradient(torch.from_numpy(x), *task.minibatch(0, client_rng(16, 0, 1)))
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-7)
        c = worker.submit(x, rows[2])
        worker.result(c)  # (answered after b: b's answer is in)
        assert b in worker._free and worker.stolen == 0
        np.testing.assert_array_equal(worker.arrays["models"][b][:x.size], x)  # skipped: still the model
        assert not np.array_equal(worker.arrays["models"][a][:x.size], x)  # (a computed one is overwritten)
    finally:
        worker.close()


def test_a_worker_that_cannot_start_leaves_the_jobs_in_process(mnist_cache, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    one = run(_spec(15, workers=1))
    monkeypatch.setattr(kp.sys, "executable", "/nonexistent/python")
    two = run(_spec(15, workers=2))
    _same_bits(one, two)
    assert _worker(15) is None
    said = [r.getMessage() for r in caplog.records if "could not start" in r.getMessage()]
    assert 1 <= len(said) <= kp.RESTARTS + kp.PROCESSES  # said once per try, and the tries end


def test_a_worker_that_hangs_or_answers_a_slot_not_ours_is_given_up(mnist_cache, monkeypatch, caplog, tmp_path):
    """A stopped worker (SIGSTOP) is given up after ``TIMEOUT``; a fake worker that answers slot 999 at
    once: both runs end on the bits of ``--workers 1``, each said in one WARNING line."""
    import time

    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    one = run(_spec(16, workers=1))
    _same_bits(one, run(_spec(16, workers=2)))  # (starts the task's worker, which the next run reuses)
    monkeypatch.setattr(kp, "TIMEOUT", 1.0)
    submit = kp.KernelProcess.submit
    sent = []

    def submit_then_stop(self, *args, **kw):
        slot = submit(self, *args, **kw)
        sent.append(slot)
        if len(sent) == 30:
            os.kill(self._proc.pid, signal.SIGSTOP)
        if len(sent) == 31:  # (the jobs sent since are owed: the next one finds the worker silent, even
            time.sleep(1.2)  # when every job it did not start is computed here instead of waited for)
        return slot

    monkeypatch.setattr(kp.KernelProcess, "submit", submit_then_stop)
    _same_bits(one, run(_spec(16, workers=2)))
    assert any("no answer within 1 s" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    monkeypatch.setattr(kp.KernelProcess, "submit", submit)

    monkeypatch.setattr(kp.sys, "executable", _stand_in_python(
        tmp_path, "import struct, sys\nout = sys.stdout.buffer\nout.write(struct.pack('<i', 0x7FFFFFF0)); out.flush()\n"
                  "while len(sys.stdin.buffer.read(4)) == 4:\n    out.write(struct.pack('<i', 999)); out.flush()\n"))
    caplog.clear()
    _same_bits(run(_spec(17, workers=1)), run(_spec(17, workers=2)))
    assert any("it answered slot 999" in r.getMessage() for r in caplog.records)


def test_local_training_in_the_worker_has_the_bits_of_one_process(mnist_cache):
    """FedBuff with model replies (3 local SGD steps, a proximal term): the worker trains the jobs."""
    kw = dict(strategy="fedbuff", budget=12, eval_every=6, local_steps=3, prox=0.01)
    one, two = run(_spec(18, **kw, workers=1)), run(_spec(18, **kw, workers=2))
    assert one["num_updates"] == two["num_updates"] > 5
    np.testing.assert_array_equal(one["final_model"], two["final_model"])
    assert [h["loss"] for h in one["history"]] == [h["loss"] for h in two["history"]]
    worker = _worker(18)  # every training but the jobs in flight at the end (some computed here: stolen)
    assert worker.answered > 0 and worker.answered + worker.stolen >= two["trainings"] - 10


def test_jobs_the_worker_cannot_compute_run_in_process_and_free_no_slot_early(mnist_cache, monkeypatch, caplog,
                                                                             tmp_path):
    """A fake worker that answers every job "could not compute", jobs pulled out of the order they were
    sent: each is computed in process as soon as it is pulled (no wait for the timeout), the run ends on
    the bits of ``--workers 1``, and one WARNING line says so."""

    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    # (it marks each job taken, as the real worker does before computing: none is computed here instead)
    exe = _stand_in_python(
        tmp_path, "import struct, sys\nimport numpy as np\nfrom fl_rescaled.tasks.kernel_process import _layout, _views\n"
                  "path, slots, size, batch = sys.argv[-5], int(sys.argv[-4]), int(sys.argv[-3]), int(sys.argv[-2])\n"
                  "mem = np.memmap(path, dtype=np.uint8, mode='r+')\n"
                  "taken = _views(mem, _layout(size, batch, slots), size)['taken']\n"
                  "out = sys.stdout.buffer\nout.write(struct.pack('<i', 0x7FFFFFF0)); out.flush()\n"
                  "while len(d := sys.stdin.buffer.read(4)) == 4:\n"
                  "    slot = struct.unpack('<i', d)[0]\n    taken[slot] = 1\n"
                  "    out.write(struct.pack('<i', slot | 0x40000000)); out.flush()\n")
    one = run(_spec(19, workers=1))
    monkeypatch.setattr(kp.sys, "executable", exe)
    monkeypatch.setattr(kp, "TIMEOUT", 5.0)
    _same_bits(one, run(_spec(19, workers=2)))
    lines = [r.getMessage() for r in caplog.records]
    assert sum("could not compute a job" in ln for ln in lines) == 1
    assert not any("no answer within" in ln for ln in lines)


def test_a_forked_child_starts_its_own_worker_and_leaves_its_parents_alone(mnist_cache):
    """After a run with the worker, a child forked from this process runs with ``--workers 2``: it gets
    its own worker (the parent's pipes untouched), both runs end on the same bits, and the parent's
    worker still answers afterwards."""
    import multiprocessing as mp

    parent = run(_spec(20, workers=2))
    mine = _worker(20)
    assert mine is not None and mine.answered > 0
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        child = pool.apply(_final_model_and_worker_pid, (20,))
    np.testing.assert_array_equal(parent["final_model"], child[0])
    assert child[1] not in (None, mine._proc.pid)
    again = run(_spec(20, workers=2))
    np.testing.assert_array_equal(parent["final_model"], again["final_model"])
    assert _worker(20) is mine and not mine.broken


def _final_model_and_worker_pid(seed: int):
    out = run(_spec(seed, workers=2))
    worker = _worker(seed)
    return out["final_model"], None if worker is None else worker._proc.pid


def test_a_job_the_worker_has_not_started_is_stolen_with_the_same_bits(mnist_cache):
    """``result(steal=True)``: a job the (stopped) worker has not started is left to the caller, which
    computes it with ``batched.rows_job`` to the worker's bits; the worker, continued, skips it and
    its slot comes back. If the worker marked the job taken first, the caller waits for it instead and
    hears it skipped (the race of both sides setting their flag at once) before computing it itself."""
    task, (X, Y, starts, sizes), worker = _own_worker(21, slots=4)
    try:
        x = task.initial_params(0)
        rows = minibatch_rows(starts, sizes, [2], [client_rng(21, 2, 5)], 64)[0]
        g, loss = worker.result(worker.submit(x, rows))  # (the worker's answer)
        os.kill(worker._proc.pid, signal.SIGSTOP)
        try:
            a, b = worker.submit(x, rows), worker.submit(x, rows)
            assert worker.result(a, steal=True) is None and worker.stolen >= 1
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # (the worker's: a run's jobs go there only on one torch thread)
            try:
                mine, my_loss = rows_job(X, Y, torch.from_numpy(x.copy()).view(1, -1),
                                           torch.from_numpy(rows[None]), 64, 0, 0.0, 0.0)
            finally:
                torch.set_num_threads(threads)
            assert mine.numpy()[0].tobytes() == g.tobytes() and my_loss == loss  # the worker's bits
            # (as if both sides had set their flag at once: the worker skips it, this side waits for it)
            worker.arrays["taken"][b] = worker.arrays["stolen"][b] = 1
            stolen = worker.stolen
        finally:
            os.kill(worker._proc.pid, signal.SIGCONT)
        assert worker.result(b, steal=True) is None and worker.stolen == stolen + 1  # heard skipped
        for _ in range(4):  # every slot free again: four jobs computed by the worker
            c = worker.submit(x, rows)
            assert c is not None
            assert worker.result(c)[0].tobytes() == g.tobytes()
        assert not worker.broken
    finally:
        worker.close()


def test_with_several_torch_threads_the_jobs_stay_in_process_with_the_bits_of_workers_1(mnist_cache):
    """The worker computes on one torch thread; with ``--torch-threads 2`` a product's bits can depend on
    the thread count and the batch, so the jobs stay in the run's lazy batches: ``--workers 2`` ends on
    the bits of ``--workers 1`` (before, it sent them to the worker and did not)."""
    one = run(_spec(22, workers=1, torch_threads=2))
    two = run(_spec(22, workers=2, torch_threads=2))
    _same_bits(one, two)
    assert _worker(22) is None
