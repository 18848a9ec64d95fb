#!/usr/bin/env python
"""One population run at C = 100, timed: the same command on any checkout, to compare two of them.

The run is ``bench_device.py``'s population (the population study's setting with one digit per client
and C = N = 100, Vanilla ASGD at the middle of its grid, seed 0), built only from
``fl_rescaled.population.config`` so that older checkouts run it too. A warm-up at a twentieth of the
budget first; then one line of JSON: the wall and CPU seconds of the run, its updates, the jobs lost
because their client went offline, and its final loss; also the CPU seconds of the thread that drives
the run (``loop_cpu_s``) and of the MNIST worker processes (``worker_cpu_s``, with ``--workers`` ≥ 2;
null where a checkout has none, or a worker stopped during the run): beside the wall seconds, which
of the two bounds the run. Alternate checkouts on one machine and compare the medians:

    PYTHONPATH=/path/to/checkout python benchmarks/bench_population_run.py [--budget 30] [--workers 1]

``--availability-period`` shortens (or lengthens) the clients' day, the study's 25 time units: with
shorter days more jobs are cut off by their client going offline, replies the run never reads.

``--message-free`` (this checkout only) also times the same work with no messages, no manager and no
validation: as many gradients and in-place steps as the run made updates, on the run's partitions,
split over two spawned processes with nothing shared (``bench_stack.bench_bare_processes``: what two
cores compute when no thread waits for another), then the run's two evaluations one after the other
(each spread over the cores as the run's are, ``MnistTask.evaluate``): the floor of the run's time on
this machine. The same gradients through
``bench_stack``'s batched kernel on two threads of one process are timed too (``kernel_threads_s``).
"""

from __future__ import annotations

import fl_rescaled  # noqa: F401  (first: Flower offline)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from fl_rescaled.experiment import run  # noqa: E402
from fl_rescaled.population.config import METHODS, SETTINGS, spec_for  # noqa: E402


def population_run(doc: str, workers: int, message_free: bool = False):
    """The command line (``--budget``, ``--workers`` defaulting to ``workers``, and ``--message-free``
    where asked) and the run's spec, on one torch thread; ``doc``'s first line describes the command."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--budget", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=workers)
    ap.add_argument("--availability-period", type=float, default=None,
                    help="the daily availability cycle's length (default: the study's); shorter days, more "
                         "jobs whose clients go offline before they end")
    if message_free:
        ap.add_argument("--message-free", action="store_true",
                        help="also time the run's gradients and evaluations with no messages (the floor)")
    a = ap.parse_args()
    period_ok = a.availability_period is None or 0 < a.availability_period < 1e6
    if not 0 < a.budget < 1e6 or a.workers < 1 or not period_ok:
        ap.error("--budget and --availability-period must be in (0, 1e6) and --workers at least 1")
    torch.set_num_threads(1)
    setting = next(s for s in SETTINGS if s.concurrency == 100 and s.dirichlet == 0)
    method = next(m for m in METHODS if m.strategy == "vanilla")
    spec = spec_for(setting, method, method.grid[len(method.grid) // 2], 0, a.budget, a.budget)
    spec = dataclasses.replace(spec, workers=a.workers)
    if a.availability_period is not None:
        spec = dataclasses.replace(spec, availability_period=a.availability_period)
    return a, spec


def floor_tools():
    """``bench_stack``'s two-process bare loop and batched kernel, or exit with one line where the
    ``fl_rescaled`` on the path is another checkout's that lacks what they use (``--message-free`` is
    for this checkout)."""
    try:
        from bench_stack import bench_bare_processes, bench_batched_kernel  # (benchmarks/ is on the path)
    except ImportError as exc:
        raise SystemExit(f"--message-free needs this checkout's fl_rescaled on the path: {exc}") from None
    return bench_bare_processes, bench_batched_kernel


def message_free(spec, updates: int, tools) -> dict:
    """Seconds of the run's arithmetic alone: ``updates`` gradients and steps on the run's partitions in
    two processes (and, for comparison, through the two-thread batched kernel of one process), and the
    two evaluations (at the initial model, twice, one after the other, each over the cores)."""
    from fl_rescaled.experiment import resolve
    from fl_rescaled.tasks import get_task

    bench_bare_processes, bench_batched_kernel = tools
    config = resolve(spec).task_config()
    task = get_task(config)
    kernel = updates / bench_bare_processes(updates, config, 2)
    bench_batched_kernel(200, task, threads=2)  # warm-up
    threads = updates / bench_batched_kernel(updates, task, threads=2)
    x = task.initial_params(spec.seed)
    t0 = time.perf_counter()
    task.evaluate(x)
    task.evaluate(x)
    evaluations = time.perf_counter() - t0
    return {"message_free_s": round(kernel + evaluations, 2), "kernel_s": round(kernel, 2),
            "evaluations_s": round(evaluations, 2), "kernel_threads_s": round(threads, 2)}


def worker_cpu() -> dict[int, float] | None:
    """CPU seconds so far of each MNIST worker process this process started, by pid (``/proc``); None
    where there are none (``--workers 1``, a checkout without them) or ``/proc`` cannot be read."""
    try:
        from fl_rescaled.tasks import kernel_process
    except ImportError:
        return None
    seconds, tick = {}, os.sysconf("SC_CLK_TCK")
    for pool in kernel_process._WORKERS.values():
        for worker in pool:
            try:
                with open(f"/proc/{worker._proc.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                return None
            seconds[worker._proc.pid] = (int(fields[11]) + int(fields[12])) / tick  # (utime + stime)
    return seconds or None


def worker_cpu_during(before: dict[int, float] | None, after: dict[int, float] | None) -> float | None:
    """The worker processes' CPU seconds between two ``worker_cpu()``: a worker started between them
    counts whole; None if one of those before is gone (its last seconds are unknown) or there are none."""
    if after is None or (before is not None and not set(before) <= set(after)):
        return None
    return round(sum(s - (before or {}).get(pid, 0.0) for pid, s in after.items()), 2)


def main() -> None:
    a, spec = population_run(__doc__, workers=1, message_free=True)
    tools = floor_tools() if a.message_free else None
    run(dataclasses.replace(spec, budget=a.budget / 20))  # warm-up: data, caches (and the worker processes)
    t0, c0, l0, k0 = time.perf_counter(), time.process_time(), time.thread_time(), worker_cpu()
    out = run(spec)
    wall, cpu, loop, k1 = time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - l0, worker_cpu()
    root = Path(fl_rescaled.__file__).resolve().parent.parent
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    row = {"checkout": head or str(root), "workers": a.workers, "budget": a.budget, "wall_s": round(wall, 2),
           "cpu_s": round(cpu, 2), "updates": out["num_updates"], "offline": out["rejected"].get("offline", 0),
           "final_loss": out.get("final_loss"), "loop_cpu_s": round(loop, 2),
           "worker_cpu_s": worker_cpu_during(k0, k1)}
    if a.message_free:
        row.update(message_free(spec, out["num_updates"], tools))
    print(json.dumps(row))


if __name__ == "__main__":
    main()
