#!/usr/bin/env python
"""CPU against GPU for the batched jobs in flight: the paper's run (C = 10), a population (C = 100).

Rows (each a whole run, median of ``--repeats`` interleaved repeats, one torch thread, workers=1 unless
said, one evaluation at the end): the run one job at a time (``--no-batch``), batched on the CPU (also
with ``--workers 2``: a batch's calls on two threads), batched on ``cuda``; and the bare loop: as many
steps as the run made updates, one gradient of the same MLP and minibatch size at a time and an
in-place step, no Flower (on the CPU: ``bench_stack``'s "same gradient" loop; on ``cuda``: one job's
batched kernels per step). Also: how far the GPU's batched gradients are from the CPU's (max |Δ| over
B = 10 jobs). Without a GPU only the CPU rows run.

    PYTHONPATH=. python benchmarks/bench_device.py [--paper-budget 2000] [--pop-budget 30] [--repeats 3]
"""

from __future__ import annotations

import fl_rescaled  # noqa: F401  (first: Flower offline)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fl_rescaled.experiment import RunSpec, run  # noqa: E402
from fl_rescaled.population.config import METHODS, SETTINGS, spec_for  # noqa: E402
from fl_rescaled.tasks import client_rng, get_task  # noqa: E402
from fl_rescaled.tasks.batched import mnist_jobs  # noqa: E402

from bench_stack import bench_bare_same_gradient  # noqa: E402  (benchmarks/ is on the path: run as a script)


def kernel_agreement(jobs: int = 10) -> float:
    """Max |g_cuda − g_cpu| over ``jobs`` batched MNIST gradients at the initial model."""
    task = get_task({"task": "mnist", "seed": 0, "num-partitions": 10, "batch-size": 64, "dirichlet-alpha": 0.0})
    x = task.initial_params(0)
    ws = [k % 10 for k in range(jobs)]
    g_cpu, _ = mnist_jobs(task, [x] * jobs, ws, [client_rng(0, w, k) for k, w in enumerate(ws)])
    g_gpu, _ = mnist_jobs(task, [x] * jobs, ws, [client_rng(0, w, k) for k, w in enumerate(ws)], device="cuda")
    return float(np.abs(g_cpu - g_gpu).max())


def bare_cuda(n_steps: int, task) -> float:
    """Steps/s of the bare loop on ``cuda``: one job's gradient per step (the batched kernels at B = 1)."""
    x = task.initial_params(0)
    n = task.num_workers
    t0 = time.perf_counter()
    for k in range(n_steps):
        w = k % n
        g, _ = mnist_jobs(task, [x], [w], [client_rng(0, w, k)], device="cuda")
        x -= np.float32(0.001) * g[0]
    return n_steps / (time.perf_counter() - t0)


def paper_spec(budget: float) -> RunSpec:
    return RunSpec(strategy="rescaled", budget=budget, eval_every=budget, lr=1.0, workers=1)


def population_spec(budget: float) -> RunSpec:
    setting = next(s for s in SETTINGS if s.concurrency == 100 and s.dirichlet == 0)
    method = next(m for m in METHODS if m.strategy == "vanilla")
    return spec_for(setting, method, method.grid[len(method.grid) // 2], 0, budget, budget)


def compare(base: RunSpec, repeats: int, gpu: bool) -> dict[str, dict]:
    modes = {"one by one (--no-batch), cpu": dict(no_batch=True), "batched, cpu": {},
             "batched, cpu, --workers 2": dict(workers=2)}
    if gpu:
        modes["batched, cuda"] = dict(device="cuda")
    run(dataclasses.replace(base, budget=base.budget / 20, eval_every=base.budget))  # warm-up
    if gpu:
        run(dataclasses.replace(base, budget=base.budget / 20, eval_every=base.budget, device="cuda"))
    task = get_task({"task": "mnist", "seed": 0, "num-partitions": 10, "batch-size": 64, "dirichlet-alpha": 0.0})
    if gpu:
        bare_cuda(20, task)  # warm-up
    times: dict[str, list[float]] = {}
    outs: dict[str, dict] = {}
    for _ in range(repeats):  # interleaved: the bare loops make as many steps as the batched run made updates
        for name, kw in modes.items():
            t0 = time.perf_counter()
            outs[name] = run(dataclasses.replace(base, **kw))
            times.setdefault(name, []).append(time.perf_counter() - t0)
        steps = outs["batched, cpu"]["num_updates"]
        bare = {"bare loop, cpu, 1 thread": lambda: bench_bare_same_gradient(steps, task, 1)}
        if gpu:
            bare["bare loop, cuda"] = lambda: bare_cuda(steps, task)
        for name, fn in bare.items():
            times.setdefault(name, []).append(steps / fn())
            torch.set_num_threads(1)
            outs[name] = {"num_updates": steps}
    ref = statistics.median(times["one by one (--no-batch), cpu"])
    bare_ref = statistics.median(times["bare loop, cpu, 1 thread"])
    rows = {}
    for name, ts in times.items():
        mid = statistics.median(ts)
        rows[name] = {"median_s": mid, "all_s": ts, "updates": outs[name]["num_updates"],
                      "updates_per_s": outs[name]["num_updates"] / mid, "x_one_by_one": ref / mid,
                      "x_bare_cpu": bare_ref / mid, "final_loss": outs[name].get("final_loss")}
        print(f"  {name:<32}{mid:8.2f} s  {rows[name]['updates_per_s']:8.0f} updates/s  ×{ref / mid:.2f} one by one  "
              f"×{bare_ref / mid:.2f} bare cpu  final loss {rows[name]['final_loss']}  "
              f"(all: {', '.join(f'{t:.2f}' for t in ts)})", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paper-budget", type=float, default=2000.0)
    ap.add_argument("--pop-budget", type=float, default=30.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    gpu = torch.cuda.is_available()
    out: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if gpu else None}
    print(f"torch {torch.__version__}, GPU: {out['gpu']}", flush=True)
    if gpu:
        out["max_abs_diff_cuda_vs_cpu"] = kernel_agreement()
        print(f"batched gradients, cuda vs cpu: max |Δ| = {out['max_abs_diff_cuda_vs_cpu']:.2e}", flush=True)
    print(f"the paper's run (rescaled, C = 10, budget {args.paper_budget:g}):", flush=True)
    out["paper"] = compare(paper_spec(args.paper_budget), args.repeats, gpu)
    print(f"a population (vanilla ASGD, N = 100, C = 100, budget {args.pop_budget:g}):", flush=True)
    out["population"] = compare(population_spec(args.pop_budget), args.repeats, gpu)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
