"""Computing the study's MNIST runs: which runs each sweep needs next, which of them are already
stored, how the rest are grouped into batches (runs that share an event order, one event loop), and
where the batches run (inline with ``--workers 1``, else a pool of worker processes)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from fl_rescaled.experiment import RunSpec, run, run_batch

from .config import PAPER_METHODS, StudyConfig
from .storage import load_stored, store_run
from .sweep import RunKey, Sweep, fmt_lr

Job = dict[str, Any]  # one batch, as sent to a worker process (plain data: it is pickled)


def quiet_logs() -> None:
    for name in ("fl_rescaled", "flwr"):
        logging.getLogger(name).setLevel(logging.ERROR)


def worker_init(threads: int) -> None:
    import torch  # heavy: imported where the runs are computed

    torch.set_num_threads(threads)
    quiet_logs()


def execute_batch(job: Job) -> list[dict[str, Any]]:
    """Run the runs of one job and store each (CSV history, then the JSON record last).

    ``job["runs"]``: [(α, seed), …] of one (setting, method) that share an event order; one run is
    ``experiment.run``, several are one batched ``experiment.run_batch`` (every replica's gradient
    in one ClientApp call per event). Module-level so worker processes can run it; returns one record, or
    {"error": ...}, per run.
    """
    keys = [RunKey(job["setting"], job["method"], float(a), int(sd)) for a, sd in job["runs"]]
    out = Path(job["out"])
    t0 = time.perf_counter()
    spec = RunSpec(task="mnist", strategy=keys[0].method, lr=keys[0].lr, delays=keys[0].setting, seed=keys[0].seed,
                   budget=job["budget"], eval_every=job["eval_every"], progress=job.get("bar", False),
                   workers=1, torch_threads=job.get("threads", 1),  # (the study's processes are its parallelism)
                   options={"clip_factor": None})  # (a batch applies no bound: its single runs not the clip either)
    try:
        outcomes = [run(spec, divergence=None)] if len(keys) == 1 else run_batch(spec, [k.lr for k in keys], [k.seed for k in keys])
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which counts the runs as failed
        return [{"error": f"{type(exc).__name__}: {exc}", "key": k.__dict__} for k in keys]
    wall = time.perf_counter() - t0
    return [store_run(out, key, outcome, job["eval_every"], wall / len(keys), len(keys))
            for key, outcome in zip(keys, outcomes)]


class Runner:
    """Schedules the runs of every sweep, inline (workers=1) or in a process pool."""

    def __init__(self, cfg: StudyConfig) -> None:
        self.cfg = cfg
        self.sweeps = [Sweep(s, m, list(cfg.grid), cfg.seeds, cfg.max_extend)
                       for s in cfg.settings for m in cfg.methods]
        self.order = sorted(range(len(self.sweeps)), key=lambda i: (self.sweeps[i].method not in PAPER_METHODS, i))
        self.computed = 0
        self.gradients = 0  # minibatch gradients (replica-steps) of the runs computed now
        self.reused = 0
        self.failed: list[dict[str, Any]] = []
        self.done = 0
        self.stage_seconds = {"sweep": 0.0, "seeds": 0.0}  # compute seconds of the runs made now
        self.t0 = time.perf_counter()

    def total(self) -> int:
        return sum(sw.planned() for sw in self.sweeps)

    def _job(self, sw: Sweep, ks: list[tuple[float, int]]) -> Job:
        # A live progress bar (stderr) only when runs are made here, one at a time, on a terminal.
        bar = self.cfg.progress and self.cfg.workers <= 1 and len(ks) == 1 and sys.stderr.isatty()
        return {"setting": sw.setting, "method": sw.method, "runs": [list(k) for k in ks], "out": str(self.cfg.out),
                "budget": self.cfg.budget, "eval_every": self.cfg.eval_every, "bar": bar, "threads": self.cfg.threads}

    def _finish(self, sw: Sweep, k: tuple[float, int], rec: dict[str, Any]) -> None:
        self.done += 1
        key = RunKey(sw.setting, sw.method, k[0], k[1])
        if "error" in rec:
            sw.failed.add(k)
            self.failed.append(rec)
            print(f"[{self.done}/{self.total()}] {key.label()}: FAILED {rec['error']}", flush=True)
            return
        sw.results[k] = rec
        self.computed += 1
        self.gradients += int(rec.get("gradients", 0))
        self.stage_seconds["sweep" if k[1] == 0 else "seeds"] += rec.get("wall_total", 0.0)
        if self.cfg.progress:
            loss = rec["final_loss"]
            div = " (diverged)" if rec.get("diverged") else ""
            # ETA: the mean wall time per run computed so far, times the runs still planned.
            per = (time.perf_counter() - self.t0) / self.computed
            eta = per * max(self.total() - self.done, 0)
            batch = f" ×{rec['batch_replicas']}" if rec.get("batch_replicas", 1) > 1 else ""
            print(f"[{self.done}/{self.total()}] {sw.method:<15}{sw.setting:<12}α={fmt_lr(k[0]):<8}seed={k[1]}  "
                  f"final loss {loss:.4g}{div}  {rec.get('wall_total', 0.0):.1f} s{batch}  (eta {eta / 60:.0f} min)",
                  flush=True)

    def _collect_needed(self, inflight: set[tuple[int, tuple[float, int]]]) -> list[tuple[Sweep, tuple[float, int]]]:
        """Reuse stored runs as far as possible; return the runs that must be computed."""
        cfg = self.cfg
        todo: list[tuple[Sweep, tuple[float, int]]] = []
        progressed = True
        while progressed:
            progressed = False
            todo = []
            # The paper's three methods first (both settings), then the extra rows: if a study is cut
            # short, what it has is what the claims are about.
            for idx in self.order:
                sw = self.sweeps[idx]
                for k in sw.needed():
                    if (idx, k) in inflight:
                        continue
                    rec = load_stored(cfg.out, RunKey(sw.setting, sw.method, k[0], k[1]), cfg.budget, cfg.eval_every)
                    if rec is not None:
                        sw.results[k] = rec
                        self.reused += 1
                        self.done += 1
                        progressed = True
                    else:
                        todo.append((sw, k))
        return todo

    def _batches(self, todo: list[tuple[Sweep, tuple[float, int]]]) -> list[tuple[Sweep, list[tuple[float, int]]]]:
        """Group the needed runs into jobs of runs that share an event order: one (setting, method)
        and, unless compute times are fixed (then every α and seed has the same events), one seed;
        at most ``--batch`` runs per job."""
        groups: dict[tuple[int, int], tuple[Sweep, list[tuple[float, int]]]] = {}
        for sw, k in todo:
            gkey = (id(sw), -1 if sw.setting == "fixed" else k[1])
            groups.setdefault(gkey, (sw, []))[1].append(k)
        jobs = []
        for sw, ks in groups.values():
            for i in range(0, len(ks), self.cfg.batch):
                jobs.append((sw, ks[i:i + self.cfg.batch]))
        return jobs

    def run(self) -> None:
        self.t0 = time.perf_counter()
        if self.cfg.report_only:
            self._collect_needed(set())
            for sw in self.sweeps:
                sw.choose_provisional()
            return
        if self.cfg.workers <= 1:
            self._run_inline()
        else:
            self._run_pool()

    def _run_inline(self) -> None:
        worker_init(self.cfg.threads)
        while True:
            jobs = self._batches(self._collect_needed(set()))
            if not jobs:
                return
            sw, ks = jobs[0]
            for k, rec in zip(ks, execute_batch(self._job(sw, ks))):
                self._finish(sw, k, rec)

    def _run_pool(self) -> None:
        ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
        index = {id(sw): i for i, sw in enumerate(self.sweeps)}
        pool = ProcessPoolExecutor(self.cfg.workers, mp_context=ctx, initializer=worker_init,
                                   initargs=(self.cfg.threads,))
        futures: dict[Any, tuple[Sweep, list[tuple[float, int]]]] = {}
        inflight: set[tuple[int, tuple[float, int]]] = set()
        try:
            while True:
                # At most `workers` jobs in the pool, so decisions (grid extensions) are not delayed.
                for sw, ks in self._batches(self._collect_needed(inflight)):
                    if len(futures) >= self.cfg.workers:
                        break
                    futures[pool.submit(execute_batch, self._job(sw, ks))] = (sw, ks)
                    inflight.update((index[id(sw)], k) for k in ks)
                if not futures:
                    break
                done, _ = wait(list(futures), return_when=FIRST_COMPLETED)
                for fut in done:
                    sw, ks = futures.pop(fut)
                    inflight.difference_update((index[id(sw)], k) for k in ks)
                    try:
                        recs = fut.result()
                    except Exception as exc:  # noqa: BLE001 - a crashed worker process
                        recs = [{"error": f"{type(exc).__name__}: {exc}"} for _ in ks]
                    for k, rec in zip(ks, recs):
                        self._finish(sw, k, rec)
        except BaseException:
            # Interrupted: drop queued runs, stop the running ones (a run writes nothing partial).
            processes = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in processes:
                proc.terminate()
            raise
        pool.shutdown(wait=True)
