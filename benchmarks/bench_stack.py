#!/usr/bin/env python
"""Throughput of the whole stack against a bare PyTorch loop, measured in one process.

Whole stack: RescaledASGD → AsyncClientManager → InProcessGrid → ClientApp → MNIST gradient, with
Flower Messages both ways, one torch thread per job (as every run of the project), with
``--workers 1`` (jobs computed when the loop needs them), ``--workers 2`` (the pool runs only the
evaluations, of which these runs have two) and ``--workers 2 --ahead`` (the pool computes the jobs in
flight as soon as they are sent). Bare loops, same N steps on the same partitions:
  (1) "same gradient": the task's own gradient function, a Python loop and an in-place update, on
      one torch thread and on torch's default threads;
  (2) "idiomatic":     nn.Sequential + CrossEntropyLoss + autograd + manual SGD step (default threads).
The ratio (stack updates/s) / (bare steps/s) is the price of going through Flower's Message API.

    python benchmarks/bench_stack.py [--updates 20000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from fl_rescaled.experiment import RunSpec, run
from fl_rescaled.tasks import client_rng, get_task


def bench_stack(n_updates: int, workers: int = 1, ahead: bool = False) -> float:
    # Budget chosen so the default harmonic τ make about n_updates updates (3.875 per time unit).
    budget = n_updates / 3.875
    t0 = time.perf_counter()
    out = run(RunSpec(strategy="rescaled", budget=budget, eval_every=budget * 10, lr=1.0, workers=workers,
                      ahead=ahead))
    dt = time.perf_counter() - t0
    return out["num_updates"] / dt


def bench_bare_same_gradient(n_steps: int, task, threads: int) -> float:
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = task.initial_params(0)
    n = task.num_workers
    t0 = time.perf_counter()
    for k in range(n_steps):
        w = k % n
        g, _ = task.gradient(x, w, client_rng(0, w, k), 64)
        x -= np.float32(0.001) * g
    rate = n_steps / (time.perf_counter() - t0)
    torch.set_num_threads(default)
    return rate


def bench_bare_idiomatic(n_steps: int, task) -> float:
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
    task = get_task({"task": "mnist", "seed": 0, "num-partitions": 10, "batch-size": 64,
                     "dirichlet-alpha": 0.0})
    task.partition(0)
    cases = {
        "stack, --workers 1": lambda: bench_stack(args.updates, 1),
        "stack, --workers 2": lambda: bench_stack(args.updates, 2),
        "stack, --workers 2 --ahead": lambda: bench_stack(args.updates, 2, True),
        "bare, same gradient, 1 thread": lambda: bench_bare_same_gradient(args.updates, task, 1),
        f"bare, same gradient, {default_threads} threads": lambda: bench_bare_same_gradient(args.updates, task,
                                                                                           default_threads),
        f"bare, idiomatic autograd, {default_threads} threads": lambda: bench_bare_idiomatic(args.updates, task),
    }
    bench_stack(2000)  # warm-up
    torch.set_num_threads(default_threads)
    rows = {k: [] for k in cases}
    for _ in range(args.repeats):  # interleaved, so machine noise hits every case alike
        for name, fn in cases.items():
            rows[name].append(fn())
            torch.set_num_threads(default_threads)
    best = {k: max(v) for k, v in rows.items()}
    base = best["bare, same gradient, 1 thread"]
    print(f"torch {torch.__version__}, {args.updates} updates, best of {args.repeats}")
    for k, v in best.items():
        print(f"  {k:<40}{v:9.0f} steps/s {1e6 / v:7.0f} µs/step  ×{v / base:.2f} of the 1-thread bare loop"
              f"   (all: {', '.join(f'{x:.0f}' for x in rows[k])})")
    print(f"projected 30,000-unit run (116,250 updates, no evaluation), --workers 1: "
          f"{116250 / best['stack, --workers 1']:.0f} s")


if __name__ == "__main__":
    main()
