#!/usr/bin/env python
"""A user's Flower app (examples/quickstart-async) in process, on Flower's engine, and as a bare loop.

Every row does the same N client trainings (``--trainings``) of the example's CNN: one epoch over
the node's 400 training examples (the app's run config: batch 32, lr 0.05), one torch thread per
job (the pool's threads and Ray's actors too), no federated or central evaluation
(``fraction-evaluate = 0``: the bare loop evaluates nothing either). Rows:

  in-process, workers=1|2  the example's ServerApp with FedBuff (buffer 10, N/10 updates) and its
                           ClientApp on ``run_inprocess``; workers=2: 2 threads compute jobs ahead
  bare loop, 1|2 threads   no Flower: the example's ``Net``/``load_data``/``train``, the same
                           partitions, FedBuff's arithmetic in torch; 2 threads: a buffer's 10 jobs
  batched helper (--helper) the same FedBuff run with the example's ``batched_app`` (``torch_client_app``:
                           plain SGD, as many minibatch steps as an epoch, the jobs in flight trained
                           in one call on ``--device``: one ``torch.func.vmap`` per step, or one job
                           after the other on the CPU, the helper's default for a CNN there;
                           ``--helper-vmap on|off|both`` forces either or adds both rows), workers=1
  Flower engine, FedAvg    the example's ServerApp with Flower's FedAvg (N/nodes rounds of every
                           node) and its ClientApp on the Simulation Engine (Ray, 2 CPUs, 1 actor
                           each), as ``run_on_flower_engine`` runs it

FedBuff does FedAvg's work: a trained model is its native reply, and one update (buffer 10, 10
nodes) is 10 trainings, as a FedAvg round. The bare loop does what a plain-PyTorch simulation of
the run must: the DataLoaders built once; per job a copy of the global state dict (the model the
job carries: an asynchronous server keeps it), loaded into a fresh ``Net``, trained; the
pseudo-gradient (sent − returned) added to a buffer, and every 10 the global model stepped by the
buffer's mean. No Messages, ArrayRecords or serialisation.

Phase 1 interleaves the in-process and bare rows (the order rotates per repeat). Phase 2 starts one
simulation (``--no-flower``: none), waits until Flower shows every node, times a cold FedAvg run
(its first round holds Ray's start-up, the actors' and their first data load), then warm runs
interleaved with the 1-thread bare loop, the engine's reference. A time is a whole run (ServerApp
start to end); the table has the best of ``--repeats`` (noise only adds time) and the median;
"train ms"/"other ms": CPU per training in this process inside the app's ``train``/around it;
"peak RSS": this process, during the row. ``--cached-codec`` adds an experiment row (see
docs/performance.md): Flower's ``Array`` (de)serialisation replaced by fl_rescaled's codec.

    python benchmarks/bench_userapp.py [--trainings 60] [--repeats 3] [--nodes 10] [--no-flower]
        [--examples-per-client 500] [--local-epochs 1] [--fraction-evaluate 0] [--cached-codec] [--json]
        [--helper [--device cpu|cuda|auto] [--helper-vmap auto|on|off|both]]
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
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
from types import SimpleNamespace
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_DIR = ROOT / "examples" / "quickstart-async"
for _p in (str(EXAMPLE_DIR), str(ROOT)):  # this checkout first; Flower passes sys.path on to Ray's workers
    if _p in sys.path:
        sys.path.remove(_p)
    sys.path.insert(0, _p)

import fl_rescaled  # noqa: E402, F401  (before flwr: Flower and Ray offline, fl_rescaled.OFFLINE_ENV)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import Array, Context, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402

from fl_rescaled import run_inprocess  # noqa: E402
from fl_rescaled.inprocess import app_run_config  # noqa: E402
from fl_rescaled.layout import decode_array, encode_array  # noqa: E402
from fl_rescaled.torch_batch import torch_client_app  # noqa: E402
from quickstart_async import client_app as example_client  # noqa: E402
from quickstart_async import server_app as example_server  # noqa: E402
from quickstart_async import task  # noqa: E402

BUFFER = 10  # FedBuff's buffer size K, which the rows give the example's ServerApp (its run-config key buffer-size)
THREADS = 1  # torch intra-op threads per job, in every row (the project's RunSpec.torch_threads)
T = TypeVar("T")
COUNTING = threading.Lock()


# -------------------------------------------------------------------- helpers
class ThreadedClientApp(ClientApp):
    """The example's ClientApp on ``THREADS`` torch threads, counting the trainings and evaluations it runs."""

    def __init__(self, inner: ClientApp) -> None:
        super().__init__()
        self.inner = inner
        self.done: list[str] = []  # the message types answered (list.append is atomic: no lock to pickle)

    def __call__(self, message: Message, context: Context) -> Message:
        if torch.get_num_threads() != THREADS:  # (a Ray actor's process, or a new thread)
            torch.set_num_threads(THREADS)
        reply = self.inner(message, context)
        if not reply.has_error():
            self.done.append(message.metadata.message_type)
        return reply

    def count(self, kind: str) -> int:
        return sum(t.startswith(kind) for t in self.done)


class TimingGrid:
    """Flower's Grid (every call delegated), with the end of every round that trained stamped and
    its replies counted. FedAvg only calls the Grid's methods, so this need not subclass ``Grid``."""

    def __init__(self, inner: Grid) -> None:
        self.inner = inner
        self.stamps: list[float] = []
        self.trainings = self.evaluations = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        kinds = [r.metadata.message_type for r in replies if not r.has_error()]
        trained = sum(k.startswith("train") for k in kinds)
        self.evaluations += sum(k.startswith("evaluate") for k in kinds)
        if trained:
            self.trainings += trained
            self.stamps.append(time.perf_counter())
        return replies


class Captured:
    """The ``Result`` of the example ServerApp's last run (``report`` replaces the app's, which prints)."""

    result: Any = None

    @classmethod
    def report(cls, name: str, initial: Any, result: Any) -> None:
        cls.result = result


def peak_rss_mb(reset: bool = False) -> float:
    """This process's peak resident memory (Linux: VmHWM); ``reset``: start a new peak (clear_refs 5)."""
    try:
        if reset:
            Path("/proc/self/clear_refs").write_text("5")
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError, ValueError):
        return float("nan")


def children_rss_mb() -> float:
    """Resident memory of this process's descendants (Ray's processes), summed."""
    parent, rss = {}, {}
    for d in Path("/proc").glob("[0-9]*"):
        try:  # (the field after the command's closing parenthesis: state, then the parent's pid)
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            rss[int(d.name)] = int((d / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    mine = {os.getpid()}
    while new := {p for p, pp in parent.items() if pp in mine} - mine:
        mine |= new
    return sum(rss.get(p, 0) for p in mine - {os.getpid()}) / 2**20


class TrainClock:
    """CPU seconds spent inside the example's ``train`` (every thread of this process): the rest of
    a row's CPU time is what goes around the training (Flower, the strategy, the copies)."""

    seconds = 0.0

    @classmethod
    def train(cls, *args: Any, **kwargs: Any) -> float:
        c0 = time.thread_time()
        try:
            return task.train(*args, **kwargs)
        finally:
            with COUNTING:
                cls.seconds += time.thread_time() - c0


COMPUTED: list[int] = []  # trainings the in-process ClientApp ran, per run


def timed(fn: Callable[[], tuple[int, int]]) -> dict[str, float]:
    """Run ``fn`` (it returns its trainings and evaluations): wall and CPU seconds (this process, all
    its threads), CPU seconds inside ``train``, peak RSS."""
    gc.collect()  # every row starts with the collector's generations empty (a full collection takes ~0.15 s)
    peak_rss_mb(reset=True)
    TrainClock.seconds = 0.0
    COMPUTED.clear()
    c0, t0 = time.process_time(), time.perf_counter()
    trainings, evaluations = fn()
    return {"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "trainings": trainings,
            "computed": COMPUTED[0] if COMPUTED else trainings, "train_cpu_s": TrainClock.seconds,
            "evaluations": evaluations, "peak_rss_mb": peak_rss_mb()}


def with_cached_codec(fn: Callable[[], T]) -> T:
    """``fn()`` with Flower's ``Array`` (de)serialisation of plain C-order arrays done by
    ``fl_rescaled.layout``'s cached-header codec (the bytes are the same as ``np.save``'s) instead of
    ``np.save``/``np.load`` (which parses every header with ``ast``): an experiment for ``--cached-codec``."""
    numpy, from_ndarray = Array.numpy, Array.from_numpy_ndarray

    def fast_numpy(self: Array) -> np.ndarray:  # (np.load's result is writable: so is the copy)
        view = SimpleNamespace(stype=self.stype, shape=self.shape, dtype=self.dtype, data=self.data,
                               numpy=lambda: numpy(self))  # decode_array's fallback: Flower's own
        return decode_array(view).copy()

    def fast_from_ndarray(cls: type, ndarray: np.ndarray) -> Array:
        if type(ndarray) is np.ndarray and ndarray.ndim and ndarray.flags.c_contiguous:
            return encode_array(ndarray)
        return from_ndarray.__func__(cls, ndarray)

    Array.numpy, Array.from_numpy_ndarray = fast_numpy, classmethod(fast_from_ndarray)
    try:
        return fn()
    finally:
        Array.numpy, Array.from_numpy_ndarray = numpy, from_ndarray


# -------------------------------------------------------------------- the rows
def app_config(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    return {"fraction-evaluate": args.fraction_evaluate, "examples-per-client": args.examples_per_client,
            "local-epochs": args.local_epochs, "buffer-size": BUFFER, **overrides}


def inprocess(args: argparse.Namespace, workers: int) -> tuple[int, int]:
    """The example app with FedBuff on the in-process Grid: (trainings it used, evaluations)."""
    app = ThreadedClientApp(example_client.app)
    config = app_config(args, strategy="fedbuff", **{"num-trainings": args.trainings})
    run_inprocess(example_server.app, app, num_supernodes=args.nodes, app_dir=EXAMPLE_DIR, run_config=config,
                  workers=workers)
    accepted, trainings = int(Captured.result.books["replies-accepted"]), app.count("train")
    if trainings < accepted:
        raise RuntimeError(f"{accepted} replies accepted but only {trainings} trainings ran")
    COMPUTED.append(trainings)  # (workers=2 may also have computed jobs still in flight at the end)
    return accepted, app.count("evaluate")


def helper_app(args: argparse.Namespace, vmap: bool | None = None) -> tuple[ClientApp, list[int]]:
    """The example's ``batched_app`` rebuilt for this run's config (epoch → steps), and its evaluations."""
    from quickstart_async.batched_app import client_data

    cfg = app_run_config(EXAMPLE_DIR, app_config(args))
    bs = int(cfg["batch-size"])
    steps = int(cfg["local-epochs"]) * math.ceil(round(task.TRAIN_SHARE * int(cfg["examples-per-client"])) / bs)
    app = torch_client_app(task.Net, torch.nn.functional.cross_entropy, client_data, batch_size=bs,
                           local_steps=steps, lr=float(cfg["learning-rate"]), device=args.device, vmap=vmap)
    evaluations: list[int] = []

    def evaluate(msg: Message, context: Context) -> Message:
        evaluations.append(1)
        return example_client.evaluate(msg, context)

    app.evaluate()(evaluate)
    return app, evaluations


def inprocess_helper(args: argparse.Namespace, vmap: bool | None = None) -> tuple[int, int]:
    """The example's ServerApp with FedBuff and the batched helper's ClientApp, in process, workers=1."""
    app, evaluations = helper_app(args, vmap)
    config = app_config(args, strategy="fedbuff", **{"num-trainings": args.trainings})
    run_inprocess(example_server.app, app, num_supernodes=args.nodes, app_dir=EXAMPLE_DIR, run_config=config,
                  workers=1)
    return int(Captured.result.books["replies-accepted"]), len(evaluations)


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
        TrainClock.train(model, loaders[node], epochs=epochs, lr=lr, device="cpu")
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
IN1_CODEC = "in-process, workers=1, cached codec"
BARE1, BARE2 = "bare loop, 1 thread", "bare loop, 2 threads"
ENGINE_COLD, ENGINE = "Flower engine FedAvg, 1st run (cold)", "Flower engine FedAvg, warm"
BARE_ALONGSIDE = "bare loop, 1 thread, in the simulation"
#: Threads that compute jobs (the engine's rows: --num-cpus actors).
HELPER = "in-process FedBuff, batched helper"
#: The helper's rows by ``--helper-vmap``: (row, the helper's ``vmap``)
HELPER_ROWS = {"auto": [(HELPER, None)], "on": [(HELPER + " (vmap)", True)],
               "off": [(HELPER + " (one after the other)", False)]}
HELPER_ROWS["both"] = HELPER_ROWS["on"] + HELPER_ROWS["off"]
CORES = {IN1: 1, IN2: 2, IN1_CODEC: 1, BARE1: 1, BARE2: 2, BARE_ALONGSIDE: 1,
         **{row: 1 for rows in HELPER_ROWS.values() for row, _ in rows}}


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
        t0 = time.perf_counter()  # FedAvg samples the nodes it sees: wait for all (else round 1 may train 2)
        while len(list(grid.get_node_ids())) < args.nodes and time.perf_counter() - t0 < 120:
            time.sleep(0.05)
        extra["nodes_visible_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rows[ENGINE_COLD] = [timed(lambda: fedavg(grid, context))]
        if not grids[0].stamps:
            raise RuntimeError("no ClientApp trained on Flower's engine (run with FLWR_LOG_LEVEL=DEBUG to see why)")
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
    loadavg_start = _loadavg()
    logging.getLogger("flwr").setLevel(logging.ERROR)
    logging.getLogger("fl_rescaled").setLevel(logging.ERROR)
    torch.set_num_threads(THREADS)
    example_server.report = Captured.report  # the app's report prints; the benchmark reads the Result
    example_client.train_model = TrainClock.train  # the ClientApp's ``train``, timed (in this process)
    small = argparse.Namespace(**{**vars(args), "trainings": BUFFER})
    for warm_up in (inprocess, bare_loop):  # (not timed): MNIST into memory, torch's and Flower's first calls
        warm_up(small, 1)
        warm_up(small, 2)

    cases: dict[str, Callable[[], tuple[int, int]]] = {IN1: lambda: inprocess(args, 1), IN2: lambda: inprocess(args, 2),
                                           BARE1: lambda: bare_loop(args, 1), BARE2: lambda: bare_loop(args, 2)}
    if args.cached_codec:
        cases[IN1_CODEC] = lambda: with_cached_codec(lambda: inprocess(args, 1))
    if args.helper:
        for row, vmap in HELPER_ROWS[args.helper_vmap]:
            inprocess_helper(small, vmap)  # (warm-up)
            cases[row] = functools.partial(inprocess_helper, args, vmap)
    names = list(cases)
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in names}
    for r in range(args.repeats):  # interleaved, the order rotated, so noise hits every row alike
        for name in names[r % len(names):] + names[:r % len(names)]:
            rows[name].append(timed(cases[name]))
    extra: dict[str, float] = {}
    if not args.no_flower:
        flower_phase(args, rows, extra)

    engine = (ENGINE_COLD, ENGINE)
    table = [summary(name, runs, rows[BARE_ALONGSIDE if name in (*engine, BARE_ALONGSIDE) else BARE1],
                     args.num_cpus if name in engine else CORES[name]) for name, runs in rows.items()]
    return {"table": table, "extra": extra, "trainings": args.trainings, "nodes": args.nodes,
            "repeats": args.repeats, "nproc": os.cpu_count(), "torch": torch.__version__,
            "loadavg_start": loadavg_start, "loadavg": _loadavg()}


def summary(name: str, runs: list[dict[str, float]], ref: list[dict[str, float]], cores: int) -> dict[str, Any]:
    """One row of the table: ``runs`` of it against ``ref``, the runs of its bare loop."""
    def median(key: Callable[[dict], float], of: list[dict[str, float]] = runs) -> float:
        return statistics.median(key(x) for x in of)

    def one(key: str) -> int | list[int]:  # the row's count, or all the counts its runs had
        counts = sorted({int(x[key]) for x in runs})
        return counts[0] if len(counts) == 1 else counts

    best, engine = min(x["seconds"] for x in runs), name in (ENGINE_COLD, ENGINE)
    return {"row": name, "cores": cores, "torch_threads_per_job": THREADS, "trainings": one("trainings"),
            "evaluations": one("evaluations"), "computed": max(x["computed"] for x in runs), "runs": len(runs),
            "best_s": best, "median_s": median(lambda x: x["seconds"]), "cpu_s": min(x["cpu_s"] for x in runs),
            "trainings_per_s": runs[0]["trainings"] / best, "x_bare": min(x["seconds"] for x in ref) / best,
            "x_bare_median": median(lambda x: x["seconds"], ref) / median(lambda x: x["seconds"]),
            "train_ms": None if engine else 1e3 * median(lambda x: x["train_cpu_s"] / x["trainings"]),
            "other_ms": None if engine else 1e3 * median(lambda x: (x["cpu_s"] - x["train_cpu_s"]) / x["trainings"]),
            "peak_rss_mb": max(x["peak_rss_mb"] for x in runs)}


def _loadavg() -> list[str]:
    """The 1, 5 and 15-minute load averages (empty off Linux)."""
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--trainings", type=int, default=60, help="client trainings per run (a multiple of 10 and of --nodes)")
    add("--nodes", type=int, default=10, help="SuperNodes (IID partitions of MNIST)")
    add("--repeats", type=int, default=3, help="interleaved runs of every row")
    add("--examples-per-client", type=int, default=500, help="the app's examples-per-client")
    add("--local-epochs", type=int, default=1, help="the app's local-epochs")
    add("--fraction-evaluate", type=float, default=0.0, help="the app's (0.5 there; the bare loop evaluates not)")
    add("--num-cpus", type=int, default=2, help="CPUs for Ray (one ClientApp actor each)")
    add("--no-flower", action="store_true", help="skip Flower's Simulation Engine (phase 2)")
    add("--cached-codec", action="store_true", help="add a workers=1 row with another Array codec (an experiment)")
    add("--helper", action="store_true", help="add the row of the example's batched helper app (batched_app)")
    add("--device", default="cpu", choices=("cpu", "cuda", "auto"), help="the helper row's device")
    add("--helper-vmap", default="auto", choices=tuple(HELPER_ROWS),
        help="the helper's batch call: its default (auto), one vmap (on), one job after the other (off), both rows")
    add("--json", action="store_true", help="print the result as JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = measure(args)
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['trainings']} trainings per run, {out['nodes']} nodes, {out['repeats']} interleaved runs per row; "
          f"torch {out['torch']}, {THREADS} torch thread per job; nproc {out['nproc']}, "
          f"load average {' '.join(out['loadavg_start'])} at the start, {' '.join(out['loadavg'])} at the end")
    columns = [("row", "row", -40, ""), ("cores", "cores", 6, ""), ("trainings", "trainings", 10, ""),
               ("evals", "evaluations", 6, ""), ("best s", "best_s", 8, ".2f"), ("median s", "median_s", 9, ".2f"),
               ("CPU s", "cpu_s", 7, ".2f"), ("trainings/s", "trainings_per_s", 12, ".2f"),
               ("× bare", "x_bare", 7, ".2f"), ("(median)", "x_bare_median", 9, ".2f"),
               ("train ms", "train_ms", 9, ".1f"), ("other ms", "other_ms", 9, ".2f"),
               ("peak RSS MB", "peak_rss_mb", 12, ".0f")]
    print("".join(f"{title:{'<' if w < 0 else '>'}{abs(w)}}" for title, _, w, _ in columns))
    for row in out["table"]:
        cells = ("-" if row[key] is None else format(row[key], f) if f else str(row[key]) for _, key, _, f in columns)
        print("".join(f"{cell:{'<' if w < 0 else '>'}{abs(w)}}" for cell, (_, _, w, _) in zip(cells, columns)))
    for row in out["table"]:
        if row["computed"] != row["trainings"]:
            print(f"{row['row']}: the ClientApp ran up to {row['computed']} trainings in a run; the jobs beyond "
                  f"{row['trainings']} were in flight at the end, already running on the pool, and were not used")
    e = out["extra"]
    if e:
        print(f"Flower engine: simulate() to the ServerApp {e['to_serverapp_s']:.1f} s, then to all nodes visible "
              f"{e['nodes_visible_s']:.1f} s; the cold run's 1st round (Ray's start-up, actors, data) "
              f"{e['cold_first_round_s']:.1f} s; a warm round {e['warm_round_s']:.2f} s; "
              f"whole simulation {e['simulation_s']:.1f} s; Ray's processes {e['ray_processes_rss_mb']:.0f} MB RSS")
    print("× bare: the 1-thread bare loop's best time over the row's (engine rows: the one in the simulation). "
          "CPU s, train ms, other ms, peak RSS: this process (not Ray's actors).")


if __name__ == "__main__":
    main()
