#!/usr/bin/env python
"""Can the MNIST kernel run beside the event loop's Python in one process? A measurement.

The stack spends about 290 µs of Python per update (Flower's Messages, validation, books) and about
330 µs in the gradient's kernels. On two cores the two could overlap only if the kernel ran while
another thread holds the GIL. This script measures, on one MNIST batch of the project's MLP (one
torch thread per kernel):

1. the batched kernel ``mlp_gradients`` compiled with TorchScript, against the eager one, bit for bit,
   and the one-job kernel's first layer (TorchScript's optimiser rewrites an ``addmm`` whose scalars
   are constants into a product and an add, which rounds otherwise);
2. one job's kernel three ways, alone: eager, the scripted function called directly, and the scripted
   function forked (``torch.jit.fork`` inside a scripted launcher, which runs it on torch's inter-op
   threads without the GIL) and waited for;
3. the same kernel beside ``--python-us`` µs of main-thread work per job: pure Python (holds the
   GIL), numpy copies of model-sized arrays and ``time.sleep`` (release it), with the kernel on a
   Python thread (eager ops: the GIL is taken back after every op) or forked from the main thread;
4. how long a forked task takes to complete while the main thread runs Python, at the default and a
   short ``sys.setswitchinterval``;
5. for contrast, the kernel in the project's worker process (``fl_rescaled.tasks.kernel_process``):
   the main process writes each job's model and rows into shared memory, sends the slot number
   through a pipe, does its Python, and collects the job 0, 1 or 3 jobs later.

    python benchmarks/bench_gil.py [--jobs 1500] [--python-us 300]

No assertion: the numbers are for docs/performance-log.md ("A GIL-free kernel").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import warnings

import numpy as np
import torch

from fl_rescaled.tasks import client_rng, get_task, task_spec
from fl_rescaled.tasks.batched import device_data, mlp_gradients
from fl_rescaled.tasks.kernel_process import KernelProcess

TASK = {"task": "mnist", "seed": 0, "num-partitions": 10, "batch-size": 64, "dirichlet-alpha": 0.0}


def kernel_inputs(X: torch.Tensor, Y: torch.Tensor, idx: torch.Tensor, ws: list[torch.Tensor], one: float):
    """(stacked models, images, labels) of a batch, as the project's batch entry builds them."""
    w = torch.stack(ws)
    B = w.shape[0]
    m = idx.shape[0] // B
    return w, X.index_select(0, idx).view(B, m, -1), Y.index_select(0, idx).view(B, m)


def scripted_gradients(X: torch.Tensor, Y: torch.Tensor, idx: torch.Tensor, ws: list[torch.Tensor],
                       one: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``tasks.batched.mlp_gradients`` in TorchScript's subset; ``one`` (= 1.0) is beta and alpha."""
    w = torch.stack(ws)
    B = w.shape[0]
    m = idx.shape[0] // B
    xb = X.index_select(0, idx).view(B, m, -1)
    yb = Y.index_select(0, idx).view(B, m)
    W1 = w[:, 0:100352].reshape(B, 128, 784)
    W2 = w[:, 100480:101760].reshape(B, 10, 128)
    h = torch.relu(torch.baddbmm(w[:, 100352:100480].unsqueeze(1), xb, W1.transpose(1, 2), beta=one, alpha=one))
    p = torch.softmax(torch.baddbmm(w[:, 101760:101770].unsqueeze(1), h, W2.transpose(1, 2), beta=one, alpha=one),
                      dim=2)
    y1 = yb.view(B, m, 1)
    py = p.gather(2, y1)
    loss = -torch.log(py.clamp_min(1e-30)).mean(dim=(1, 2))
    p.scatter_(2, y1, py.sub_(one))
    p /= m
    g = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    torch.bmm(p.transpose(1, 2), h, out=g[:, 100480:101760].view(B, 10, 128))
    torch.sum(p, 1, out=g[:, 101760:101770])
    dh = torch.bmm(p, W2)
    dh.mul_(torch.sign(h))
    torch.bmm(dh.transpose(1, 2), xb, out=g[:, 0:100352].view(B, 128, 784))
    torch.sum(dh, 1, out=g[:, 100352:100480])
    return g, loss


def first_layer_addmm(xb: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The one-job kernel's first layer (``tasks.mnist.mlp_gradient``): ``addmm`` with its constant scalars."""
    return torch.relu(torch.addmm(w[100352:100480], xb, w[0:100352].view(128, 784).t()))


def process_pipeline(x0: torch.Tensor, sizes, starts, work, us: float, depth: int, n: int) -> float:
    """µs per job when the main process sends each job to the project's worker process
    (``fl_rescaled.tasks.kernel_process``: model and rows into a shared-memory slot, the slot's number
    through a pipe), does ``us`` µs of ``work`` and collects the job ``depth`` − 1 jobs later (its
    gradient copied out, as a reply's encoding copies it)."""
    task = get_task(TASK)
    worker = KernelProcess(task_spec(TASK), task.size, task.batch_size, slots=depth + 2)
    try:
        x = x0.numpy()
        inflight: list[int] = []
        t0 = time.perf_counter()
        for j in range(n):
            rows = client_rng(0, j % 10, j).choice(int(sizes[j % 10]), 64, replace=False) + starts[j % 10]
            inflight.append(worker.submit(x, rows))
            work(us)
            if len(inflight) >= depth:
                worker.result(inflight.pop(0))
        while inflight:
            worker.result(inflight.pop(0))
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        worker.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1500)
    ap.add_argument("--python-us", type=float, default=300.0)
    a = ap.parse_args()
    if a.jobs < 1 or not 0 <= a.python_us <= 1e6:
        ap.error("--jobs must be at least 1 and --python-us between 0 and 1e6")
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch 2.14 warns that torch.jit.script is deprecated: an experiment)
        script = torch.jit.script(scripted_gradients)
        script_addmm = torch.jit.script(first_layer_addmm)

        def launch(X: torch.Tensor, Y: torch.Tensor, idx: torch.Tensor, ws: list[torch.Tensor], one: float):
            return torch.jit.fork(script, X, Y, idx, ws, one)

        launcher = torch.jit.script(launch)
    task = get_task(TASK)
    X, Y, starts, sizes = device_data(task, "cpu")
    x0 = torch.from_numpy(task.initial_params(0))

    def batch(B: int, k: int):
        gen = torch.Generator().manual_seed(k)
        ws = [x0 + 0.01 * torch.randn(x0.shape[0], generator=gen) for _ in range(B)]
        rows = [client_rng(0, (k + j) % 10, k).choice(int(sizes[(k + j) % 10]), 64, replace=False)
                + starts[(k + j) % 10] for j in range(B)]
        return ws, torch.from_numpy(np.concatenate(rows))

    print(f"torch {torch.__version__}, one intra-op thread, one inter-op thread; Python {sys.version.split()[0]}")
    same = same_addmm = True
    for k in range(20):
        ws, idx = batch(1 + k % 4, k)
        g1, l1 = mlp_gradients(*kernel_inputs(X, Y, idx, ws, 1.0))
        for _ in range(3):  # past TorchScript's profiling runs
            g2, l2 = script(X, Y, idx, ws, 1.0)
            g3, l3 = launcher(X, Y, idx, ws, 1.0).wait()
            same &= torch.equal(g1, g2) and torch.equal(l1, l2) and torch.equal(g1, g3) and torch.equal(l1, l3)
            xb = X.index_select(0, idx[:64])
            same_addmm &= torch.equal(first_layer_addmm(xb, ws[0]), script_addmm(xb, ws[0]))
    print(f"1. bits: scripted = eager (B = 1..4, 20 batches, direct and forked): {same}; "
          f"the one-job kernel's addmm layer scripted = eager: {same_addmm}")

    ws, idx = batch(1, 0)
    n = a.jobs

    def eager_job():
        mlp_gradients(*kernel_inputs(X, Y, idx, ws, 1.0))

    def timed(fn, reps: int = 3) -> float:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            out.append((time.perf_counter() - t0) / n * 1e6)
        return statistics.median(out)

    solo = {"eager": timed(eager_job), "scripted, called": timed(lambda: script(X, Y, idx, ws, 1.0)),
            "scripted, forked and waited": timed(lambda: launcher(X, Y, idx, ws, 1.0).wait())}
    print("2. one job alone, µs: " + ", ".join(f"{k} {v:.0f}" for k, v in solo.items()))

    arr = np.ones(x0.shape[0], np.float32)

    def python_work(us: float) -> None:
        t = time.perf_counter() + us * 1e-6
        d: dict[int, str] = {}
        while time.perf_counter() < t:
            for i in range(50):
                d[i] = str(i)

    def numpy_work(us: float) -> None:
        t = time.perf_counter() + us * 1e-6
        while time.perf_counter() < t:
            b = arr.copy()
            b *= 2

    works = {"pure Python": python_work, "numpy copies": numpy_work, "sleep": lambda us: time.sleep(us * 1e-6)}
    us = a.python_us
    print(f"3. µs per job with {us:.0f} µs of main-thread work per job (serial would be kernel + {us:.0f}):")
    for wname, work in works.items():
        # the main thread launches the job, does its work, then collects the job's result
        t0 = time.perf_counter()
        for _ in range(n):
            fut = launcher(X, Y, idx, ws, 1.0)
            work(us)
            fut.wait()
        forked = (time.perf_counter() - t0) / n * 1e6
        done = threading.Event()

        def on_thread() -> None:
            for _ in range(n):
                eager_job()
            done.set()

        th = threading.Thread(target=on_thread)
        t0 = time.perf_counter()
        th.start()
        for _ in range(n):
            work(us)
        th.join()
        threaded = (time.perf_counter() - t0) / n * 1e6
        print(f"   {wname:<13} forked from the main thread {forked:6.0f}   eager on a Python thread {threaded:6.0f}")

    print("4. a forked job's completion while the main thread runs pure Python (median of 200, µs):")
    for sw in (sys.getswitchinterval(), 2e-5):
        old = sys.getswitchinterval()
        sys.setswitchinterval(sw)
        lat = []
        for _ in range(200):
            t0 = time.perf_counter()
            fut = launcher(X, Y, idx, ws, 1.0)
            d: dict[int, str] = {}
            while not fut.done():
                for i in range(50):
                    d[i] = str(i)
            lat.append((time.perf_counter() - t0) * 1e6)
            fut.wait()
        sys.setswitchinterval(old)
        print(f"   switch interval {sw * 1e6:.0f} µs: {statistics.median(lat):.0f} (alone: "
              f"{solo['scripted, forked and waited']:.0f})")


    print(f"5. the kernel in the project's worker process (shared-memory models, a pipe for the slot numbers), beside "
          f"{us:.0f} µs of main-thread pure Python per job, µs per job (in process, serial: about "
          f"{solo['eager'] + us:.0f}):")
    for depth in (1, 2, 4):
        print(f"   a job collected {depth - 1} job(s) after it was sent: "
              f"{process_pipeline(x0, sizes, starts, python_work, us, depth, n):.0f}")


if __name__ == "__main__":
    main()
