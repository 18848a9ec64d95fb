#!/usr/bin/env python
"""What batching replicas buys: replica-steps per second of ``run_batch`` with one replica, five
replicas with different seeds (the five-seed stage) and five with one seed (an α sweep), in one
process on one torch thread, interleaved so machine noise hits all three alike. Fixed compute
times, MNIST, no evaluation (``eval_every`` past the budget), so only the event loop is timed.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_batch.py [--budget 1000] [--repeats 2]
"""

from __future__ import annotations

import fl_rescaled  # noqa: F401  (first: Flower and Ray offline, fl_rescaled.OFFLINE_ENV)

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

CASES = {"1 replica": [0], "5 replicas, 5 seeds": [0, 1, 2, 3, 4], "5 replicas, 1 seed": [0, 0, 0, 0, 0]}


def rate(budget: float, seeds: list[int]) -> float:
    from fl_rescaled.experiment import RunSpec, run_batch

    spec = RunSpec(task="mnist", strategy="rescaled", delays="fixed", budget=budget, eval_every=1e12, progress=False)
    t0 = time.perf_counter()
    outs = run_batch(spec, [1.0] * len(seeds), seeds)
    return sum(o["gradients"] for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=1000.0)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rate(50.0, [0, 1])  # loads the data, warms up
    rows: dict[str, list[float]] = {k: [] for k in CASES}
    for _ in range(args.repeats):
        for name, seeds in CASES.items():
            rows[name].append(rate(args.budget, seeds))
    base = max(rows["1 replica"])
    print(f"torch {torch.__version__}, 1 thread, budget {args.budget:g}, best of {args.repeats}")
    for name, vals in rows.items():
        print(f"  {name:<22}{max(vals):7.0f} replica-steps/s  {1e6 / max(vals):5.0f} µs each  "
              f"×{max(vals) / base:.2f}   (all: {', '.join(f'{v:.0f}' for v in vals)})")


if __name__ == "__main__":
    main()
