#!/usr/bin/env python
"""Where an update's time goes: the MNIST stack under cProfile, each function's own time put in a bin.

One process, one torch thread, ``--workers 1``, no evaluation inside the timed run; the same run
with the jobs in flight batched (the default) and one by one (``--no-batch``). The bins: torch's
kernels (the gradient itself), Flower's records and messages (``flwr``), the manager, driver and
strategy, validation and encoding (``layout``, ``bounds``, ``peer_bounds``, ``messages``,
``matching``), the in-process Grid (``grid``, ``grid_batch``, ``batching``), the ClientApp and the
task's Python (``clients``, ``tasks``: decoding, job generators, minibatch draws), numpy, the rest.
cProfile slows Python down, not the kernels: the scaled column keeps the kernels' time and shrinks
the other bins alike to the unprofiled time of the same run (an estimate). Times are the process's
CPU time (``time.process_time``: one thread, so a shared, loaded machine inflates them less than wall
time); the function calls per update are exact and do not depend on the load.

    PYTHONPATH=. python benchmarks/profile_update.py [--updates 8000] [--cpu-ratios]

``--cpu-ratios`` prints instead the CPU µs per update of the batched stack (the marginal cost: a run
of 2n updates minus a run of n, so the start-up and the two evaluations cancel), of the batched
kernel alone (``bench_stack``'s, C = 10, one thread) and of the bare loop (one thread), and the
stack's part that is not the kernel ("ours"). Run it alternately on two checkouts (``PYTHONPATH``)
to compare them on a shared machine.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from fl_rescaled.experiment import RunSpec, run

BINS = (
    ("torch kernels", ("{built-in method torch.", "{method '", "torch/")),
    ("Flower records and messages", ("flwr/",)),
    ("manager, driver, strategy", ("fl_rescaled/manager/", "fl_rescaled/driver", "fl_rescaled/algorithm",
                                   "strategies/", "fl_rescaled/runstate", "fl_rescaled/stepsizes",
                                   "fl_rescaled/clock", "fl_rescaled/divergence")),
    ("validation and encoding", ("fl_rescaled/layout", "fl_rescaled/bounds", "fl_rescaled/peer_bounds",
                                 "fl_rescaled/messages", "fl_rescaled/matching")),
    ("in-process Grid", ("fl_rescaled/grid", "fl_rescaled/batching")),
    ("ClientApp and task (Python)", ("clients/", "fl_rescaled/tasks/")),
    ("numpy", ("numpy/",)),
)


def _bin(where: str, name: str) -> str:
    if where == "~":
        # built-ins: torch's (kernels) if named so, numpy's ufuncs and array methods, else Python's
        if "torch" in name:
            return "torch kernels"
        if "numpy" in name or "ufunc" in name or "ndarray" in name:
            return "numpy"
        if "bytes" in name:
            return "bytes copies (join)"
        return "Python built-ins"
    for label, keys in BINS:
        if any(k in where for k in keys if not k.startswith("{")):
            return label
    return "other"


def spec(updates: int, batch: bool) -> RunSpec:
    budget = updates / 3.875
    return RunSpec(strategy="rescaled", budget=budget, eval_every=budget * 10, lr=1.0, workers=1, no_batch=not batch)


def profile(updates: int, batch: bool) -> None:
    run(spec(500, batch))  # warm-up: data, caches
    t0 = time.process_time()
    out = run(spec(updates, batch))
    wall = time.process_time() - t0
    prof = cProfile.Profile()
    t0 = time.process_time()
    prof.enable()
    run(spec(updates, batch))
    prof.disable()
    profiled = time.process_time() - t0
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    bins: dict[str, float] = {}
    calls = sum(nc for (_cc, nc, _tt, _ct, _callers) in stats.values())
    for (path, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        b = _bin(path, name)
        bins[b] = bins.get(b, 0.0) + tottime
    n = out["num_updates"]
    total = sum(bins.values())
    kern = bins.get("torch kernels", 0.0)
    # (on a loaded machine the profiled kernels may take longer than the whole unprofiled run: no estimate then)
    shrink = (wall - kern) / (profiled - kern) if wall > kern and profiled > kern else float("nan")
    print(f"\n{'batched' if batch else 'one by one (--no-batch)'}: {n} updates, {1e6 * wall / n:.0f} CPU µs/update "
          f"unprofiled, {1e6 * profiled / n:.0f} profiled, {calls / n:.0f} Python function calls per update")
    print(f"  {'bin':<30}{'profiled µs/update':>20}{'scaled':>16}{'share':>8}")
    for b, t in sorted(bins.items(), key=lambda kv: -kv[1]):
        scaled = t if b == "torch kernels" else t * shrink
        print(f"  {b:<30}{1e6 * t / n:20.0f}{1e6 * scaled / n:16.0f}{t / total:8.0%}")


def cpu_ratios(updates: int) -> None:
    from bench_stack import bench_bare_same_gradient, bench_batched_kernel  # (benchmarks/ is the script's folder)

    from fl_rescaled.tasks import get_task

    def stack(n: int) -> tuple[float, int]:
        t0 = time.process_time()
        out = run(spec(n, True))
        return time.process_time() - t0, out["num_updates"]

    def cpu_per_step(fn) -> float:
        t0 = time.process_time()
        fn()
        return 1e6 * (time.process_time() - t0) / updates

    stack(300)  # warm-up
    (t1, u1), (t2, u2) = stack(updates), stack(2 * updates)
    marginal = 1e6 * (t2 - t1) / (u2 - u1)
    task = get_task({"task": "mnist", "seed": 0, "num-partitions": 10, "batch-size": 64, "dirichlet-alpha": 0.0})
    kernel = cpu_per_step(lambda: bench_batched_kernel(updates, task, 1))
    bare = cpu_per_step(lambda: bench_bare_same_gradient(updates, task, 1))
    print(f"CPU µs/update: stack {marginal:.0f}, batched kernel alone {kernel:.0f}, bare loop {bare:.0f}; "
          f"ours (stack − kernel) {marginal - kernel:.0f}; stack × bare {bare / marginal:.2f}, "
          f"× kernel {kernel / marginal:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=8000)
    ap.add_argument("--cpu-ratios", action="store_true",
                    help="CPU µs per update of the stack, the batched kernel and the bare loop (no profile)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    if args.cpu_ratios:
        cpu_ratios(args.updates)
        return
    for batch in (False, True):
        profile(args.updates, batch)


if __name__ == "__main__":
    main()
