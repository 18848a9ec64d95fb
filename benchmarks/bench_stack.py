#!/usr/bin/env python
"""Throughput of the whole stack against a bare PyTorch loop, measured in one process.

Whole stack: RescaledASGD → AsyncClientManager → InProcessGrid → ClientApp → MNIST gradient, with
Flower Messages both ways, one torch thread per job (as every run of the project), with
``--workers 1`` (the jobs in flight computed in lazy batches: ``fl_rescaled.grid_batch``) and
``--workers 2`` (each gradient computed in a worker process from the moment its job is sent:
``fl_rescaled.tasks.kernel_process``; with two worker processes, as on three cores or more, and with
every gradient free, the loop alone: the bound with enough worker processes), and one by one
(``--no-batch``, which also keeps the gradients in process; with ``--ahead`` the pool computes them
as soon as they are sent). Bare loops, same N steps on the same partitions:
  (1) "same gradient": the task's own gradient function, a Python loop and an in-place update, on
      one torch thread and on torch's default threads;
      and on one thread with the other kernel (torch's BLAS where the default is oneDNN, oneDNN where
      it is BLAS, ``mnist.onednn``: what the kernel choice alone changes on this CPU);
  (2) "idiomatic":     nn.Sequential + CrossEntropyLoss + autograd + manual SGD step (default threads, 1);
  (3) "batched kernel": C = 10 jobs' minibatch draws and gradients per call (``mnist_jobs``), in
      chunks of ``CPU_CHUNK`` jobs spread over 1 or 2 threads as the stack's batches are, and the same
      in-place update per gradient: the batched stack's arithmetic in one process, with no messages;
  (4) "2 processes": the "same gradient" loop split over two spawned processes, each with its own model
      and one torch thread, nothing shared or sent between them: what two cores compute when no
      thread waits for another's GIL, the physical reference of ``--workers 2`` on two cores.
The ratio (stack updates/s) / (bare steps/s) is the price of going through Flower's Message API.
Every row is the median of ``--repeats`` interleaved repeats. After the table, where the time of the
``--workers 2`` runs with one worker process went: the event loop's CPU, its own and the jobs it took
from the worker, the worker's CPU a job, and the bound of the two processes perfectly balanced
(``balance_line``).

    python benchmarks/bench_stack.py [--updates 20000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from fl_rescaled.experiment import RunSpec, run
from fl_rescaled.batching import plan_chunks
from fl_rescaled.clients.client_app import CPU_CHUNK
from fl_rescaled.tasks import client_rng, get_task
from fl_rescaled.tasks import kernel_process as kp
from fl_rescaled.tasks import mnist
from fl_rescaled.tasks.batched import mnist_jobs


def paper_run(n_updates: int, workers: int = 1, ahead: bool = False, batch: bool = True,
              observers=None) -> tuple[dict, float]:
    """The stack's run (its outcome, its wall seconds): budget chosen so the default harmonic τ make about
    ``n_updates`` updates (3.875 per time unit), no evaluation inside it; ``observers`` as ``run``'s."""
    budget = n_updates / 3.875
    t0 = time.perf_counter()
    out = run(RunSpec(strategy="rescaled", budget=budget, eval_every=budget * 10, lr=1.0, workers=workers,
                      ahead=ahead, no_batch=not batch), observers=observers)
    return out, time.perf_counter() - t0


def bench_stack(n_updates: int, workers: int = 1, ahead: bool = False, batch: bool = True) -> float:
    out, dt = paper_run(n_updates, workers, ahead, batch)
    return out["num_updates"] / dt


def bench_stack_processes(n_updates: int, processes: int) -> float:
    """The stack with ``--workers 2`` and ``processes`` worker processes (``kernel_process.PROCESSES``)."""
    default, kp.PROCESSES = kp.PROCESSES, processes
    try:
        return bench_stack(n_updates, 2)
    finally:
        kp.PROCESSES = default


def bench_stack_balance(n_updates: int, seen: list[dict[str, float]]) -> float:
    """``bench_stack_processes(n_updates, 1)``, and where its updates' time went, appended to ``seen``
    (µs an update unless said): ``T`` the wall time; ``loop`` the CPU of the thread that runs the event
    loop, of which ``steal_cpu`` went to the jobs it computed itself because the worker had not started
    them when their replies were wanted (``steals`` an update, ``batched.rows_job`` in this process);
    ``worker`` the worker process's CPU and ``jobs`` the jobs it answered an update (``/proc``)."""
    import fl_rescaled.clients.client_app as app

    from bench_population_run import worker_cpu, worker_cpu_during

    real, spent = app.rows_job, [0.0, 0]

    def rows_job(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            spent[0] += time.thread_time() - t0
            spent[1] += 1

    default, kp.PROCESSES, app.rows_job = kp.PROCESSES, 1, rows_job
    try:
        answered = sum(w.answered for pool in kp._WORKERS.values() for w in pool)
        c0, k0 = time.thread_time(), worker_cpu()
        out, wall = paper_run(n_updates, 2)
        loop, k1 = time.thread_time() - c0, worker_cpu()
        answered = sum(w.answered for pool in kp._WORKERS.values() for w in pool) - answered
    finally:
        kp.PROCESSES, app.rows_job = default, real
    u, worker = out["num_updates"], worker_cpu_during(k0, k1)
    seen.append({"T": 1e6 * wall / u, "loop": 1e6 * loop / u, "steal_cpu": 1e6 * spent[0] / u, "steals": spent[1] / u,
                 "worker": float("nan") if worker is None else 1e6 * worker / u, "jobs": answered / u})
    return u / wall


def balanced_bound(L: float, S: float, W: float) -> tuple[float, float]:
    """The time an update of the two processes perfectly balanced, and the share of the jobs the loop
    computes then: the event loop's own work ``L`` plus a share ``f`` of the jobs at ``S`` each, against
    the worker's ``(1 - f)`` jobs at ``W`` each; the smallest ``max(L + f S, (1 - f) W)`` is at
    ``f* = (W - L) / (S + W)`` when ``W > L`` (else at f* = 0: the loop alone). ``S`` NaN (no job was
    computed by the loop): f = 0."""
    if S != S:
        return max(L, W), 0.0
    f = max(0.0, (W - L) / (S + W))
    return max(L + f * S, (1 - f) * W), f


def balance_line(seen: list[dict[str, float]], bare: float) -> str:
    """The medians of ``bench_stack_balance``'s rows, per update and per job, and ``balanced_bound``
    of them. ``bare``: the 1-thread bare loop's steps/s."""
    med = {k: statistics.median(r[k] for r in seen) for k in seen[0]}
    S = med["steal_cpu"] / med["steals"] if med["steals"] else float("nan")
    L, W = med["loop"] - med["steal_cpu"], med["worker"] / med["jobs"]
    best, f = balanced_bound(L, S, W)
    return (f"--workers 2, one worker process, where an update's time goes (medians of {len(seen)}): {med['T']:.0f} µs "
            f"an update; the event loop {med['loop']:.0f} µs of CPU ({med['loop'] / med['T']:.0%} busy) = {L:.0f} of "
            f"its own + {med['steals']:.3f} stolen jobs × {S:.0f}; the worker {W:.0f} µs a job × {med['jobs']:.2f} "
            f"({med['worker'] / med['T']:.0%} busy); perfectly balanced: {best:.0f} µs at {f:.3f} stolen "
            f"(×{1e6 / best / bare:.2f} of the 1-thread bare loop, against ×{1e6 / med['T'] / bare:.2f} measured)")


def bench_loop_alone(n_updates: int, task) -> float:
    """The stack with ``--workers 2`` where every job's gradient is free: its model is copied into a slot
    as a real job's is, and one precomputed gradient answers it at once, with nothing sent to the worker.
    What the event loop costs alone: the bound that more worker processes (more cores) approach. Not a
    run's trajectory (every update is that gradient)."""
    grad, loss = task.gradient(task.initial_params(0), 0, client_rng(0, 0, 0), 64)
    grad = np.ascontiguousarray(grad, np.float32)
    real = {name: getattr(kp.KernelProcess, name) for name in ("submit", "result", "abandon")}

    def submit(self, model, rows, *job):
        self.arrays["models"][0] = model
        return 0

    kp.KernelProcess.submit = submit
    kp.KernelProcess.result = lambda self, slot, use=None, steal=False: use(grad, float(loss))
    kp.KernelProcess.abandon = lambda self, slot: None
    try:
        return bench_stack(n_updates, 2)
    finally:
        for name, fn in real.items():
            setattr(kp.KernelProcess, name, fn)


def bench_bare_same_gradient(n_steps: int, task, threads: int, first: int = 0, every: int = 1) -> float:
    """Steps per second of the bare loop: steps ``first``, ``first + every``, … below ``n_steps`` (all of
    them by default; ``bench_bare_processes`` gives each process its share)."""
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = task.initial_params(0)
    n = task.num_workers
    steps = range(first, n_steps, every)
    t0 = time.perf_counter()
    for k in steps:
        w = k % n
        g, _ = task.gradient(x, w, client_rng(0, w, k), task.batch_size)
        x -= np.float32(0.001) * g
    rate = len(steps) / (time.perf_counter() - t0)
    torch.set_num_threads(default)
    return rate


def bench_batched_kernel(n_steps: int, task, threads: int, jobs: int = 10) -> float:
    """``jobs`` gradients per round through ``mnist_jobs``, chunked as the stack's batches, on ``threads``
    threads of one torch thread each; then each gradient's in-place update, as the bare loop."""
    torch.set_num_threads(1)
    x = task.initial_params(0)
    n = task.num_workers
    cuts = plan_chunks(jobs, CPU_CHUNK)
    pool = ThreadPoolExecutor(threads, initializer=torch.set_num_threads, initargs=(1,)) if threads > 1 else None
    t0 = time.perf_counter()
    for k0 in range(0, n_steps, jobs):
        ks = list(range(k0, k0 + jobs))
        ws = [k % n for k in ks]
        rngs = [client_rng(0, w, k) for w, k in zip(ws, ks)]
        calls = [(task, [x] * (c.stop - c.start), ws[c], rngs[c]) for c in cuts]
        parts = list(pool.map(lambda a: mnist_jobs(*a)[0], calls)) if pool else [mnist_jobs(*a)[0] for a in calls]
        for g in np.concatenate(parts):
            x -= np.float32(0.001) * g
    rate = (n_steps // jobs * jobs) / (time.perf_counter() - t0)
    if pool:
        pool.shutdown()
    return rate


def _bare_share(spec: dict, n_steps: int, first: int, every: int, start, said) -> None:
    """One spawned process's share of ``bench_bare_processes``: steps ``first``, ``first + every``, … of
    the "same gradient" loop on its own model, after a warm-up and once every share has said it is ready."""
    task = get_task(spec)
    bench_bare_same_gradient(200, task, 1)  # warm-up: data, partitions, caches
    said.put("ready")
    start.wait()
    bench_bare_same_gradient(n_steps, task, 1, first, every)
    said.put("done")


def bench_bare_processes(n_steps: int, spec: dict, processes: int = 2) -> float:
    """Steps per second of the "same gradient" loop split over ``processes`` spawned processes (the task
    ``spec``, each process its own model, nothing shared): timed from the moment all are ready to the
    last one's end. A process that exits before it is done stops the benchmark with its exit code."""
    ctx = multiprocessing.get_context("spawn")  # (a fork would carry this process's torch threads and workers)
    start, said = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_bare_share, args=(spec, n_steps, i, processes, start, said), daemon=True)
             for i in range(processes)]
    for p in procs:
        p.start()

    def hear(word: str, within: float = 600.0) -> None:
        deadline = time.monotonic() + within
        for _ in procs:
            while True:
                try:
                    got = said.get(timeout=1.0)
                    break
                except queue.Empty:
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"a process of the two-process bare loop exited with {dead[0]}") from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the two-process bare loop said no {word!r} in {within:.0f} s") from None
            assert got == word, got

    try:
        hear("ready")
        t0 = time.perf_counter()
        start.set()
        hear("done")
        return n_steps / (time.perf_counter() - t0)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def bench_bare_other_kernel(n_steps: int, task) -> float:
    """The "same gradient" bare loop on one thread with the other kernel for the two large products
    (torch's BLAS where this CPU's default is oneDNN's inner product, and the reverse)."""
    default, mnist._ONEDNN = mnist._ONEDNN, not mnist.onednn()
    try:
        return bench_bare_same_gradient(n_steps, task, 1)
    finally:
        mnist._ONEDNN = default


def bench_bare_idiomatic(n_steps: int, task, threads: int | None = None) -> float:
    default = torch.get_num_threads()
    torch.set_num_threads(threads or default)
    try:
        return _idiomatic(n_steps, task)
    finally:
        torch.set_num_threads(default)


def _idiomatic(n_steps: int, task) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    lossf = torch.nn.CrossEntropyLoss()
    parts = [task.partition(i) for i in range(task.num_workers)]
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for k in range(n_steps):
        X, Y = parts[k % len(parts)]
        idx = torch.from_numpy(rng.choice(Y.shape[0], 64, replace=False))
        model.zero_grad(set_to_none=True)
        lossf(model(X[idx]), Y[idx]).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.001 * p.grad
    return n_steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    default_threads = torch.get_num_threads()
    other = "torch's BLAS" if mnist.onednn() else "oneDNN"
    spec = {"task": "mnist", "seed": 0, "num-partitions": 10, "batch-size": 64, "dirichlet-alpha": 0.0}
    task = get_task(spec)
    task.partition(0)
    balance: list[dict[str, float]] = []
    cases = {
        "stack, --workers 1 (batched)": lambda: bench_stack(args.updates, 1),
        "stack, --workers 2, one worker process": lambda: bench_stack_balance(args.updates, balance),
        "stack, --workers 2, two worker processes": lambda: bench_stack_processes(args.updates, 2),
        "loop alone (every gradient free)": lambda: bench_loop_alone(args.updates, task),
        "stack, --workers 1 --no-batch": lambda: bench_stack(args.updates, 1, batch=False),
        "stack, --workers 2 --no-batch": lambda: bench_stack(args.updates, 2, batch=False),
        "stack, --workers 2 --no-batch --ahead": lambda: bench_stack(args.updates, 2, True, batch=False),
        "batched kernel, C = 10, 1 thread": lambda: bench_batched_kernel(args.updates, task, 1),
        "batched kernel, C = 10, 2 threads": lambda: bench_batched_kernel(args.updates, task, 2),
        "bare, same gradient, 1 thread": lambda: bench_bare_same_gradient(args.updates, task, 1),
        "bare, same gradient, 2 processes": lambda: bench_bare_processes(args.updates, spec, 2),
        f"bare, same gradient, {default_threads} threads": lambda: bench_bare_same_gradient(args.updates, task,
                                                                                           default_threads),
        f"bare, idiomatic autograd, {default_threads} threads": lambda: bench_bare_idiomatic(args.updates, task),
        "bare, idiomatic autograd, 1 thread": lambda: bench_bare_idiomatic(args.updates, task, 1),
    }
    if mnist.onednn() or mnist.onednn_available():  # (the other kernel, where this torch has both)
        cases[f"bare, same gradient, 1 thread, {other}"] = lambda: bench_bare_other_kernel(args.updates, task)
    bench_stack(2000)  # warm-up
    bench_stack_processes(500, 2)  # (starts the gradients' two worker processes: later runs of this task reuse them)
    torch.set_num_threads(default_threads)
    rows = {k: [] for k in cases}
    for _ in range(args.repeats):  # interleaved, so machine noise hits every case alike
        for name, fn in cases.items():
            rows[name].append(fn())
            torch.set_num_threads(default_threads)
    mid = {k: statistics.median(v) for k, v in rows.items()}
    base = mid["bare, same gradient, 1 thread"]
    kernel = mid["batched kernel, C = 10, 2 threads"]
    user = mid["bare, idiomatic autograd, 1 thread"]
    cores = mid["bare, same gradient, 2 processes"]
    print(f"torch {torch.__version__}, {args.updates} updates, median of {args.repeats} interleaved repeats; "
          f"the MLP's large products through {mnist.kernel_name()}")
    for k, v in mid.items():
        print(f"  {k:<44}{v:9.0f} steps/s {1e6 / v:7.0f} µs/step  ×{v / base:.2f} of the 1-thread bare loop"
              f"  ×{v / user:.2f} of the 1-thread autograd loop  ×{v / kernel:.2f} of the 2-thread batched kernel"
              f"  ×{v / cores:.2f} of the 2-process bare loop   (all: {', '.join(f'{x:.0f}' for x in rows[k])})")
    print(balance_line(balance, base))
    print(f"projected 30,000-unit run (116,250 updates, no evaluation), --workers 2, one worker process: "
          f"{116250 / mid['stack, --workers 2, one worker process']:.0f} s")


if __name__ == "__main__":
    main()
