#!/usr/bin/env python
"""A user's Flower app (examples/quickstart-async) in process, on Flower's engine, and as a bare loop.

Every row does the same number N of client trainings of the example's CNN (``--trainings``), one
epoch over the node's 400 training examples each (the app's run config: batch 32, lr 0.05), on one
torch thread per job, with no federated or central evaluation (``fraction-evaluate = 0``; the
bare loop evaluates nothing either):

  in-process, workers=1   the example's ServerApp with FedBuff (buffer 10, N/10 updates) and its
                          ClientApp on ``fl_rescaled.run_inprocess``: jobs run when pulled
  in-process, workers=2   the same, ``workers=2``: 2 threads compute the jobs in flight ahead
  bare loop, 1 thread     no Flower: the example's ``Net``/``load_data``/``train`` on the same
                          partitions, FedBuff's arithmetic in plain torch (below)
  bare loop, 2 threads    the same, the 10 jobs of each buffer on 2 threads
  Flower engine, FedAvg   the example's ServerApp with Flower's FedAvg (N/nodes rounds of every
                          node) and its ClientApp on Flower's Simulation Engine (Ray, 2 CPUs, one
                          ClientApp actor per CPU), as ``run_on_flower_engine`` runs it

The bare loop is what a plain-PyTorch simulation of the same run must do: build each partition's
DataLoader once, then per job copy the global state dict (the model the job carries: an
asynchronous server keeps it, since the global moves on), load it into a fresh ``Net``, train, and
on the server add the pseudo-gradient (sent − returned) to the buffer; every 10 replies step the
global model by the buffer's mean. It has none of Flower's Messages, ArrayRecords or
serialisation, and no per-job ``load_data`` (the ClientApp calls it on every job).

Phase 1 interleaves the in-process rows and the bare loops (the order rotates per repeat). Phase 2
starts one simulation (``--no-flower`` skips it): Ray's start-up and a first, cold FedAvg run
(actors start, load torch and MNIST) are timed once, then warm FedAvg runs are interleaved with the
1-thread bare loop in the same simulation, whose ratio uses that bare loop. Each time is a whole
run (ServerApp start to end); the table gives the best of ``--repeats`` (noise only adds time) and
the median. "peak RSS" is this process's high-water mark during the row (reset before it).

    python benchmarks/bench_userapp.py [--trainings 60] [--repeats 3] [--nodes 10] [--no-flower] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_DIR = ROOT / "examples" / "quickstart-async"
for _p in (str(EXAMPLE_DIR), str(ROOT)):  # this checkout first; Flower passes sys.path on to Ray's workers
    if _p in sys.path:
        sys.path.remove(_p)
    sys.path.insert(0, _p)

import fl_rescaled  # noqa: E402, F401  (before flwr: Flower and Ray offline, fl_rescaled.OFFLINE_ENV)
import torch  # noqa: E402
from flwr.app import Context, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402

from fl_rescaled import run_inprocess  # noqa: E402
from fl_rescaled.inprocess import app_run_config  # noqa: E402
from quickstart_async import client_app as example_client  # noqa: E402
from quickstart_async import server_app as example_server  # noqa: E402
from quickstart_async import task  # noqa: E402

BUFFER = 10  # FedBuff's default buffer size K, which the example's ServerApp uses
THREADS = 1  # torch intra-op threads per job, in every row (the project's RunSpec.torch_threads)


# -------------------------------------------------------------------- helpers
class ThreadedClientApp(ClientApp):
    """The example's ClientApp on ``THREADS`` torch threads, counting the trainings and evaluations it runs."""

    def __init__(self, inner: ClientApp) -> None:
        super().__init__()
        self.inner = inner
        self.trainings = self.evaluations = 0
        self._lock = threading.Lock()

    def __call__(self, message: Message, context: Context) -> Message:
        if torch.get_num_threads() != THREADS:  # (a Ray actor's process, or a new thread)
            torch.set_num_threads(THREADS)
        reply = self.inner(message, context)
        if not reply.has_error():
            with self._lock:
                self.trainings += message.metadata.message_type.startswith("train")
                self.evaluations += message.metadata.message_type.startswith("evaluate")
        return reply

    def __getstate__(self) -> dict:  # (pickled to Ray's actors: the lock stays here)
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class TimingGrid(Grid):
    """Flower's Grid, with the end of every round that trained stamped and its replies counted."""

    def __init__(self, inner: Grid) -> None:
        self.inner = inner
        self.stamps: list[float] = []
        self.trainings = self.evaluations = 0

    def set_run(self, run) -> None:  # pragma: no cover - Flower sets the run before main
        self.inner.set_run(run)

    @property
    def run(self):
        return self.inner.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        trained = sum(1 for r in replies if r.metadata.message_type.startswith("train") and not r.has_error())
        self.evaluations += sum(1 for r in replies if r.metadata.message_type.startswith("evaluate")
                                and not r.has_error())
        if trained:
            self.trainings += trained
            self.stamps.append(time.perf_counter())
        return replies


class Captured:
    """The ``Result`` of the example ServerApp's last run (its ``report`` is replaced by this)."""

    result: Any = None

    @classmethod
    def report(cls, name: str, initial: Any, result: Any) -> None:
        del name, initial
        cls.result = result


def peak_rss_reset() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def children_rss_mb() -> float:
    """Resident memory of this process's descendants (Ray's processes), summed."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            rss[int(d.name)] = int((d / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    mine, grew = {os.getpid()}, True
    while grew:
        new = {p for p, pp in parents.items() if pp in mine and p not in mine}
        mine |= new
        grew = bool(new)
    return sum(rss.get(p, 0) for p in mine - {os.getpid()}) / 2**20


def timed(fn: Callable[[], tuple[int, int]]) -> dict[str, float]:
    """Run ``fn`` (it returns its trainings and evaluations): wall and CPU seconds (this process, all
    its threads), peak RSS."""
    peak_rss_reset()
    c0, t0 = time.process_time(), time.perf_counter()
    trainings, evaluations = fn()
    return {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "trainings": trainings,
            "evaluations": evaluations, "peak_rss_mb": peak_rss_mb()}


# -------------------------------------------------------------------- the rows
def app_config(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    return {"fraction-evaluate": args.fraction_evaluate, "examples-per-client": args.examples_per_client,
            "local-epochs": args.local_epochs, **overrides}


def inprocess(args: argparse.Namespace, workers: int) -> tuple[int, int]:
    """The example app with FedBuff on the in-process Grid: (trainings it used, evaluations)."""
    app = ThreadedClientApp(example_client.app)
    config = app_config(args, strategy="fedbuff", **{"num-updates": args.trainings // BUFFER})
    run_inprocess(example_server.app, app, num_supernodes=args.nodes, app_dir=EXAMPLE_DIR, run_config=config,
                  workers=workers)
    accepted = int(Captured.result.books["replies-accepted"])
    if app.trainings < accepted:
        raise RuntimeError(f"{accepted} replies accepted but only {app.trainings} trainings ran")
    return accepted, app.evaluations


def bare_loop(args: argparse.Namespace, threads: int) -> tuple[int, int]:
    """FedBuff's work without Flower (see the module's docstring): (trainings it ran, 0)."""
    cfg = app_run_config(EXAMPLE_DIR, app_config(args))
    loaders = [task.load_data(i, args.nodes, int(cfg["batch-size"]), int(cfg["examples-per-client"]))[0]
               for i in range(args.nodes)]
    epochs, lr = int(cfg["local-epochs"]), float(cfg["learning-rate"])
    global_sd = task.Net().state_dict()
    buffer = {k: torch.zeros_like(v) for k, v in global_sd.items()}

    def job(node: int, sent: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if torch.get_num_threads() != THREADS:
            torch.set_num_threads(THREADS)
        model = task.Net()
        model.load_state_dict(sent)
        task.train(model, loaders[node], epochs=epochs, lr=lr, device="cpu")
        return model.state_dict()

    done = 0
    with ThreadPoolExecutor(max_workers=threads) as pool:
        run_jobs = pool.map if threads > 1 else map  # 1 thread: in this thread, as workers=1 runs its jobs
        while done < args.trainings:
            nodes = [(done + j) % args.nodes for j in range(BUFFER)]
            sent = {k: v.clone() for k, v in global_sd.items()}  # the model these jobs carry
            for returned in run_jobs(job, nodes, [sent] * len(nodes)):
                for k, v in buffer.items():
                    v += sent[k] - returned[k]  # the pseudo-gradient, staleness weight 1
            for k, v in global_sd.items():
                v -= buffer[k] / BUFFER
                buffer[k].zero_()
            done += len(nodes)
    return done, 0


IN1, IN2 = "in-process FedBuff, workers=1", "in-process FedBuff, workers=2"
BARE1, BARE2 = "bare loop, 1 thread", "bare loop, 2 threads"
ENGINE_COLD, ENGINE = "Flower engine FedAvg, 1st run (cold)", "Flower engine FedAvg, warm"
BARE_ALONGSIDE = "bare loop, 1 thread, in the simulation"
#: Threads that compute jobs in each row (Ray: 2 ClientApp actors on 2 CPUs, --num-cpus).
CORES = {IN1: 1, IN2: 2, BARE1: 1, BARE2: 2, ENGINE_COLD: 2, ENGINE: 2, BARE_ALONGSIDE: 1}


def flower_phase(args: argparse.Namespace, rows: dict[str, list], extra: dict[str, float]) -> None:
    """One simulation: a first (cold) FedAvg run, then warm runs interleaved with the bare loop."""
    from fl_rescaled.flower_sim import simulate

    rounds = args.trainings // args.nodes
    config = app_run_config(EXAMPLE_DIR, app_config(args, strategy="fedavg", **{"num-server-rounds": rounds}))
    grids: list[TimingGrid] = []

    def fedavg(grid: Grid, context: Context) -> tuple[int, int]:
        grids.append(TimingGrid(grid))
        example_server.app(grids[-1], context)
        return grids[-1].trainings, grids[-1].evaluations

    def main(grid: Grid, context: Context) -> None:
        extra["to_serverapp_s"] = time.perf_counter() - t_call
        t0 = time.perf_counter()
        rows[ENGINE_COLD] = [timed(lambda: fedavg(grid, context))]
        extra["cold_first_round_s"] = grids[0].stamps[0] - t0
        for r in range(args.repeats):
            cases = [(ENGINE, lambda: fedavg(grid, context)), (BARE_ALONGSIDE, lambda: bare_loop(args, 1))]
            for name, fn in cases[r % 2:] + cases[:r % 2]:
                rows.setdefault(name, []).append(timed(fn))
        warm_rounds = [b - a for g in grids[1:] for a, b in zip(g.stamps, g.stamps[1:])]
        extra["warm_round_s"] = statistics.median(warm_rounds) if warm_rounds else float("nan")
        extra["ray_processes_rss_mb"] = children_rss_mb()

    t_call = time.perf_counter()
    simulate(main, num_supernodes=args.nodes, client_app=ThreadedClientApp(example_client.app), run_config=config,
             num_cpus=args.num_cpus)
    extra["simulation_s"] = time.perf_counter() - t_call


# -------------------------------------------------------------------- main
def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every row's runs and the table (see ``main``)."""
    if args.trainings < BUFFER or args.trainings % BUFFER or args.trainings % args.nodes:
        raise SystemExit(f"--trainings must be a positive multiple of {BUFFER} (FedBuff's buffer) and of --nodes")
    logging.getLogger("flwr").setLevel(logging.ERROR)
    logging.getLogger("fl_rescaled").setLevel(logging.ERROR)
    torch.set_num_threads(THREADS)
    example_server.report = Captured.report  # the app's report prints; the benchmark reads the Result
    small = argparse.Namespace(**{**vars(args), "trainings": BUFFER})
    inprocess(small, 1)  # warm-up (not timed): MNIST into memory, imports, the first ClientApp calls
    bare_loop(small, 1)

    cases: dict[str, Callable[[], tuple[int, int]]] = {IN1: lambda: inprocess(args, 1), IN2: lambda: inprocess(args, 2),
                                           BARE1: lambda: bare_loop(args, 1), BARE2: lambda: bare_loop(args, 2)}
    names = list(cases)
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in names}
    for r in range(args.repeats):  # interleaved, the order rotated, so noise hits every row alike
        for name in names[r % len(names):] + names[:r % len(names)]:
            rows[name].append(timed(cases[name]))
    extra: dict[str, float] = {}
    if not args.no_flower:
        flower_phase(args, rows, extra)

    table = []
    for name, runs in rows.items():
        ref = rows[BARE_ALONGSIDE if name in (ENGINE_COLD, ENGINE, BARE_ALONGSIDE) else BARE1]
        counts = sorted({int(x["trainings"]) for x in runs})
        evals = sorted({int(x["evaluations"]) for x in runs})
        best, best_ref = min(x["seconds"] for x in runs), min(x["seconds"] for x in ref)
        table.append({
            "row": name, "cores": CORES[name], "torch_threads_per_job": THREADS,
            "trainings": counts[0] if len(counts) == 1 else counts, "runs": len(runs),
            "evaluations": evals[0] if len(evals) == 1 else evals,
            "best_s": best, "median_s": statistics.median(x["seconds"] for x in runs),
            "cpu_s": min(x["cpu_s"] for x in runs), "trainings_per_s": counts[0] / best, "x_bare": best_ref / best,
            "x_bare_median": statistics.median(x["seconds"] for x in ref) / statistics.median(
                x["seconds"] for x in runs),
            "peak_rss_mb": max(x["peak_rss_mb"] for x in runs),
        })
    return {"table": table, "extra": extra, "trainings": args.trainings, "nodes": args.nodes,
            "repeats": args.repeats, "nproc": os.cpu_count(), "torch": torch.__version__,
            "loadavg": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainings", type=int, default=60, help="client trainings per run (a multiple of 10 and --nodes)")
    ap.add_argument("--nodes", type=int, default=10, help="SuperNodes (IID partitions of MNIST)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of every row")
    ap.add_argument("--examples-per-client", type=int, default=500, help="the app's examples-per-client")
    ap.add_argument("--local-epochs", type=int, default=1, help="the app's local-epochs")
    ap.add_argument("--fraction-evaluate", type=float, default=0.0,
                    help="the app's fraction-evaluate (its default, 0.5, adds federated evaluations; the bare loop has none)")
    ap.add_argument("--num-cpus", type=int, default=2, help="CPUs for Ray (one ClientApp actor each)")
    ap.add_argument("--no-flower", action="store_true", help="skip Flower's Simulation Engine (phase 2)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = measure(args)
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['trainings']} trainings per run, {out['nodes']} nodes, {out['repeats']} interleaved runs per row; "
          f"torch {out['torch']}, {THREADS} torch thread per job; nproc {out['nproc']}, "
          f"load average {' '.join(out['loadavg'])} (at the end)")
    print(f"{'row':<40}{'cores':>6}{'trainings':>10}{'evals':>6}{'best s':>8}{'median s':>9}{'CPU s':>7}{'trainings/s':>12}"
          f"{'× bare':>7}{'(median)':>9}{'peak RSS MB':>12}")
    for row in out["table"]:
        print(f"{row['row']:<40}{row['cores']:>6}{row['trainings']!s:>10}{row['evaluations']!s:>6}{row['best_s']:>8.2f}{row['median_s']:>9.2f}"
              f"{row['cpu_s']:>7.2f}{row['trainings_per_s']:>12.2f}{row['x_bare']:>7.2f}{row['x_bare_median']:>9.2f}"
              f"{row['peak_rss_mb']:>12.0f}")
    e = out["extra"]
    if e:
        print(f"Flower engine: simulate() to the ServerApp {e['to_serverapp_s']:.1f} s; the cold run's 1st round "
              f"(Ray's start-up, actors, data) {e['cold_first_round_s']:.1f} s; a warm round {e['warm_round_s']:.2f} s; "
              f"whole simulation {e['simulation_s']:.1f} s; Ray's processes {e['ray_processes_rss_mb']:.0f} MB RSS")
    print(f"trainings/s and × bare from the best runs; × bare = the 1-thread bare loop's time over the row's "
          f"(engine rows: the bare loop run in the simulation, between them). CPU s: this process only (not Ray's "
          f"actors). Peak RSS: this process, during the row.")


if __name__ == "__main__":
    main()
