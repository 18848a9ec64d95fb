#!/usr/bin/env python
"""Where the event loop's time goes in the population run, by wall-clock timers around its parts.

``bench_population_run.py``'s run (N = C = 100, Vanilla ASGD, seed 0), with ``--workers 2`` by
default: the loop beside its worker process, which a profiler would slow down unevenly (cProfile
slows the loop's Python, not the worker). Each part below is wrapped by a ``perf_counter`` timer
(about a microsecond each); the table gives its time per update (nested parts are inside their
callers' time) and its calls per update, then what the worker process did: jobs answered, jobs
the loop computed itself (stolen). A warm-up run at a twentieth of the budget first.

    python benchmarks/time_update_parts.py [--budget 30] [--workers 2]
"""

from __future__ import annotations

import fl_rescaled  # noqa: F401  (first: Flower offline)

import collections  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402

from bench_population_run import population_run  # noqa: E402  (benchmarks/ is on the path: run as a script)
from fl_rescaled import driver, layout, run_api  # noqa: E402
from fl_rescaled.clients import client_app  # noqa: E402
from fl_rescaled.experiment import run  # noqa: E402
from fl_rescaled.grid_batch import LazyBatches  # noqa: E402
from fl_rescaled.manager import manager, transport  # noqa: E402
from fl_rescaled.tasks import kernel_process  # noqa: E402

#: (owner, attribute, label): the loop's parts, in the order of an update
PARTS = (
    (driver.Driver, "update", "the update (all of it)"),
    (manager.AsyncClientManager, "next_ended", "1. the next reply"),
    (LazyBatches, "reply", "   the Grid: a reply"),
    (kernel_process.KernelProcess, "result", "   the worker's result, encoded as a reply"),
    (kernel_process.KernelProcess, "_fill", "   waiting for the worker (and reading it)"),
    (client_app, "rows_job", "   a job the loop computes (stolen)"),
    (manager.AsyncClientManager, "validate", "2. validation"),
    (manager.AsyncClientManager, "apply_bounds", "3. the bounds"),
    (manager.AsyncClientManager, "book", "4. the books"),
    (run_api.RunAPI, "apply", "5. the step"),
    (manager.AsyncClientManager, "send", "6. the next job"),
    (layout.ModelLayout, "encode", "   the model, encoded"),
    (transport.Transport, "push_job", "   the message, pushed"),
    (LazyBatches, "push", "   the Grid: a push"),
    (kernel_process.KernelProcess, "submit", "   the model into the worker's slot"),
    (client_app, "job_rng", "   the job's generator"),
    (client_app, "minibatch_rows", "   the job's minibatch rows"),
)


def timed(fn, label: str, spent: collections.Counter, calls: collections.Counter):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t0
            calls[label] += 1
    return wrapper


def main() -> None:
    a, spec = population_run(__doc__, workers=2)
    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for owner, name, label in PARTS:
        setattr(owner, name, timed(getattr(owner, name), label, spent, calls))
    run(dataclasses.replace(spec, budget=a.budget / 20))  # warm-up: data, caches, the worker
    spent.clear()
    calls.clear()
    workers = [w for pool in kernel_process._WORKERS.values() for w in pool]
    before = [(w.answered, w.stolen) for w in workers]
    t0 = time.perf_counter()
    out = run(spec)
    wall = time.perf_counter() - t0
    n = out["num_updates"]
    print(f"{n} updates in {wall:.2f} s: {wall / n * 1e6:.0f} µs per update (--workers {a.workers})")
    print(f"{'µs/update':>10} {'calls/update':>13}  part")
    for _, _, label in PARTS:
        if calls[label]:
            print(f"{spent[label] / n * 1e6:10.1f} {calls[label] / n:13.2f}  {label}")
    for w, (answered, stolen) in zip(workers, before):
        print(f"worker process: {w.answered - answered} jobs answered, {w.stolen - stolen} computed by the loop")


if __name__ == "__main__":
    main()
