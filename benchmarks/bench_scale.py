#!/usr/bin/env python
"""Updates per second against the number of clients, next to a bare heap-driven loop of the same
algorithm, and the peak memory of a run, measured in one invocation.

Rescaled ASGD on 1-d quadratics F_i(x) = (x − i)², τ_i = 1 + i mod 7 (fixed), about ``--updates``
updates per run, evaluated only at the start and the end:

- ``stack``: ``fl_rescaled.experiment.run`` (strategy → client manager → in-process Grid → the
  project's ClientApp, real Flower Messages both ways), rate from the run's own wall time;
- ``bare``: a Python loop with a heap of finishing times doing the same updates (each gradient at
  the model its worker was sent), no Flower;
- ``floor``: Flower's part alone, per update: the job Message (a ConfigRecord with the same keys and
  the model's ArrayRecord) and the reply Message (ArrayRecord and MetricRecord), built and read as the
  stack does, with no manager, strategy or task;
- peak memory: each stack run is a fresh process; its ``ru_maxrss`` is reported.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_scale.py [--clients 10,100,1000,10000] [--updates 75000]
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def taus_of(n: int) -> list[float]:
    return [float(1 + i % 7) for i in range(n)]


def budget_for(n: int, updates: int) -> float:
    return updates / sum(1.0 / t for t in taus_of(n))


def bare(n: int, updates: int, lr: float = 0.01) -> float:
    """Updates per second of the same algorithm in plain Python (a heap of finishing times)."""
    taus = taus_of(n)
    tau_max = max(taus)
    b = [float(i) for i in range(n)]
    x = 0.0
    sent = [0.0] * n
    heap = [(taus[i], i) for i in range(n)]
    heapq.heapify(heap)
    budget = budget_for(n, updates)
    t0 = time.perf_counter()
    k = 0
    while heap[0][0] <= budget:
        t, i = heapq.heappop(heap)
        g = 2.0 * (sent[i] - b[i])
        x -= lr * (1.0 / n) * taus[i] / tau_max * g
        sent[i] = x
        heapq.heappush(heap, (t + taus[i], i))
        k += 1
    return k / (time.perf_counter() - t0)


def floor(updates: int) -> float:
    """Per update, only what Flower's constructors and accessors cost (the stack builds as much)."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    from fl_rescaled.grid import InProcessGrid, set_server_identity
    from fl_rescaled.layout import decode_array, encode_array

    grid = InProcessGrid(__import__("fl_rescaled.clients.client_app", fromlist=["app"]).app, 1)
    set_server_identity(grid.run.run_id)
    x = np.zeros(1)
    node = grid.node_ids[0]
    cfg = {"task": '{"num-partitions": 10, "quad-a": [1.0], "quad-b": [0.0], "quad-dim": 1, "task": "quadratic"}'}
    t0 = time.perf_counter()
    for k in range(updates):
        arrays = ArrayRecord()
        arrays["model"] = encode_array(x)
        job = Message(RecordDict({"arrays": arrays, "config": ConfigRecord(
            {**cfg, "job-id": k, "worker": 0, "version": k, "job-seq": k, "server-round": k + 1})}), node, "train")
        y = decode_array(job.content["arrays"]["model"])
        reply_arrays = ArrayRecord()
        reply_arrays["model"] = encode_array(y)
        reply = Message(RecordDict({"arrays": reply_arrays, "metrics": MetricRecord(
            {"loss": 0.0, "num-examples": 64, "compute-time": 0.0})}), reply_to=job)
        decode_array(reply.content["arrays"]["model"])
        dict(reply.content["metrics"])
    return updates / (time.perf_counter() - t0)


STACK = """
import time
t0 = time.perf_counter()
import json, resource, sys
import fl_rescaled
from fl_rescaled.experiment import RunSpec, run
imported = time.perf_counter() - t0
n, budget, c = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
spec = RunSpec(task="quadratic", strategy="rescaled", lr=0.01, taus=[float(1 + i % 7) for i in range(n)],
               budget=budget, eval_every=budget, seed=0, workers=1, options={"concurrency": c} if c else {})
t1 = time.perf_counter()
out = run(spec)
total = time.perf_counter() - t1
loop = out["loop_seconds"]
print(json.dumps({"updates": out["num_updates"], "wall": loop, "imports": imported, "setup": total - loop,
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def stack(n: int, updates: int, concurrency: int = 0) -> dict:
    """One run in a fresh process: the loop's updates per second, the import and set-up seconds (to the
    first job) and the peak resident memory."""
    c = concurrency or n
    budget = updates / (c * float(np.mean([1.0 / t for t in taus_of(n)])))
    res = subprocess.run([sys.executable, "-c", STACK, str(n), repr(budget), str(concurrency)], cwd=ROOT,
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["rate"] = out["updates"] / out["wall"]
    return out


def population(updates: int) -> None:
    """Issue 19's targets: 100,000 clients with C = 1,000 in flight against 10 clients (all busy) and
    against 1,000 clients with the same C, each in a fresh process."""
    rows = [(10, 0), (1000, 1000), (100_000, 1000)]
    print(f"{'clients':>8} {'C':>6} {'updates':>8} {'upd/s':>8} {'vs 10':>6} {'imports s':>9} {'setup s':>8} "
          f"{'peak MB':>8} {'vs 1,000':>8}")
    runs = {}
    for n, c in rows:
        runs[n] = r = stack(n, updates, c)
        print(f"{n:>8} {c or n:>6} {r['updates']:>8} {r['rate']:>8,.0f} {r['rate'] / runs[10]['rate']:>6.2f} "
              f"{r['imports']:>9.2f} {r['setup']:>8.2f} {r['maxrss_mb']:>8.0f} "
              f"{r['maxrss_mb'] / runs[1000]['maxrss_mb'] if 1000 in runs else float('nan'):>8.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="10,100,1000,10000")
    ap.add_argument("--updates", type=int, default=75000)
    ap.add_argument("--population", action="store_true",
                    help="100,000 clients with 1,000 in flight against 10 and 1,000 clients (issue 19)")
    args = ap.parse_args()
    if args.population:
        population(args.updates)
        return
    sizes = [int(c) for c in args.clients.split(",")]
    fl = floor(min(args.updates, 20000))
    print(f"Flower floor (constructors and accessors only): {fl:,.0f} updates/s")
    print(f"{'clients':>8} {'stack upd/s':>12} {'bare upd/s':>12} {'stack/bare':>10} {'stack/floor':>11} "
          f"{'vs 10 clients':>13} {'peak MB':>8}")
    first = None
    for n in sizes:
        s, b = stack(n, args.updates), bare(n, args.updates)
        first = first or s["rate"]
        print(f"{n:>8} {s['rate']:>12,.0f} {b:>12,.0f} {s['rate'] / b:>10.4f} {s['rate'] / fl:>11.2f} "
              f"{s['rate'] / first:>13.2f} {s['maxrss_mb']:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
