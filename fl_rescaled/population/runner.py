"""Computing the study's runs: one sweep (``paper.sweep.Sweep``) per (setting, method), stepped in
rounds: every run the sweeps need next (grid values on seed 0, then an extension past an edge, then the
other seeds at the chosen value) is computed on a process pool, then the sweeps decide, until none
needs more. A run whose record is stored (same budget, evaluation period and population model) is
reused. Runs go through ``experiment.run`` and are stored by ``paper.storage.store_run``."""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from fl_rescaled.data import load_mnist, mix_size, partition_labels, shared_examples
from fl_rescaled.experiment import RunSpec, resolve, run
from fl_rescaled.paper.runner import worker_init
from fl_rescaled.paper.storage import SCHEMA, read_json, run_paths, store_run
from fl_rescaled.paper.sweep import RunKey, Sweep, clean

from .config import BY_NAME, MODEL, SETTINGS, Method, PopulationConfig, Setting, model_tag, spec_for

Job = dict[str, Any]  # one run, as sent to a worker process (plain data)


def half_step(a: float, up: bool) -> float:
    """The neighbour of ``a`` on the 1, 3, 10, 30, … ladder (0.3 → 1 up, 0.1 → 0.03 down)."""
    e = math.floor(math.log10(a) + 1e-9)
    m = a / 10**e
    if up:
        return clean((3.0 if m < 2.0 else 10.0) * 10**e)
    return clean((0.3 if m < 2.0 else 1.0) * 10**e)


class HalfDecadeSweep(Sweep):
    """The paper's sweep (choice by seed 0's final loss, extension past an edge), extended on the
    1, 3, 10, … ladder at every scale (the paper's goes by ×10 below 1)."""

    def _decide(self) -> None:
        low, high = self.alphas[0], self.alphas[-1]
        super()._decide()
        if self.alphas[-1] != high:
            self.alphas[-1] = half_step(high, up=True)
        if self.alphas[0] != low:
            self.alphas[0] = half_step(low, up=False)


@lru_cache(maxsize=1)
def _train_labels(data_dir: str | None) -> np.ndarray:
    return load_mnist(data_dir).train_y  # (once per process: every run of a worker process reads the same)


def partition_info(spec: RunSpec) -> dict[str, Any]:
    """What the partition of ``spec`` (resolved) is, for the report: the core's (``--partition mix``)."""
    labels = _train_labels(spec.data_dir)
    size = mix_size(labels, spec.num_clients)
    if size != MODEL["partition_size"]:
        raise ValueError(f"the mix partition gives {size} examples per client, the study says {MODEL['partition_size']}")
    if spec.dirichlet_alpha == 0:
        return {"kind": "one class per client (fl_rescaled.data.partition_labels)", "size": size}
    parts = partition_labels(labels, spec.num_clients, spec.dirichlet_alpha, spec.seed, scheme=spec.partition)
    return {"kind": f"per-client Dirichlet({spec.dirichlet_alpha:g}) label mix, equal sizes", "size": size,
            "classes_per_client_mean": float(np.mean([np.unique(labels[i]).size for i in parts])),
            "shared_examples": shared_examples(parts),
            "core_trimmed_size": len(partition_labels(labels, spec.num_clients, spec.dirichlet_alpha, spec.seed)[0])}


def execute(job: Job) -> dict[str, Any]:
    """Compute one run and store it (CSV history, then the JSON record); returns its record, or
    {"error": ...}. Module-level, so worker processes can run it."""
    setting, method = Setting(job["dirichlet"], job["concurrency"]), BY_NAME[job["method"]]
    key = RunKey(setting.label, method.name, job["value"], job["seed"])
    out = Path(job["out"])
    t0 = time.perf_counter()
    try:
        spec = resolve(spec_for(setting, method, job["value"], job["seed"], job["budget"], job["eval_every"]))
        partition = partition_info(spec)
        outcome = run(spec, divergence=None)  # (a sweep records a diverged run as +inf)
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which counts the run as failed
        return {"error": f"{type(exc).__name__}: {exc}", "key": key.__dict__}
    outcome["curve"] = {k: [h.get(k) for h in outcome["history"]]
                        for k in ("time", "loss", "accuracy", "worst_client_loss")}
    outcome["study"] = {"setting": setting.label, "method": method.name, "knob": method.knob, "value": job["value"],
                        "model_tag": model_tag(), "partition": partition,
                        "concurrency": spec.options.get("concurrency", spec.num_clients)}
    return store_run(out, key, outcome, job["eval_every"], time.perf_counter() - t0, 1)


def load_record(out: Path, key: RunKey, budget: float, eval_every: float) -> dict[str, Any] | None:
    """The stored record of a finished run of this study (its JSON alone: the curve is in it), or None."""
    rec = read_json(run_paths(out, key)[1])
    if (not isinstance(rec, dict) or rec.get("schema") != SCHEMA
            or (rec.get("study") or {}).get("model_tag") != model_tag()
            or not math.isclose(rec.get("budget", -1), budget) or not math.isclose(rec.get("eval_every", -1), eval_every)):
        return None
    return rec


@dataclass
class Cell:
    """The sweep of one (setting, method)."""

    setting: Setting
    method: Method
    sweep: Sweep


class Runner:
    """Schedules every cell's runs, round by round, on ``cfg.workers`` processes (inline with 1)."""

    def __init__(self, cfg: PopulationConfig) -> None:
        self.cfg = cfg
        self.cells = [Cell(s, m, HalfDecadeSweep(s.label, m.name, cfg.grid(m), cfg.seeds, cfg.max_extend))
                      for s in cfg.settings for m in cfg.methods]
        self.computed = self.reused = 0
        self.gradients = 0
        self.failed: list[dict[str, Any]] = []

    def cell(self, setting: Setting, method: Method) -> Cell:
        return next(c for c in self.cells if c.setting == setting and c.method == method)

    def planned(self) -> int:
        return sum(c.sweep.planned() for c in self.cells)

    def _needed(self) -> list[tuple[Cell, tuple[float, int]]]:
        """Reuse stored runs while that moves a sweep on; return the runs to compute next."""
        cfg = self.cfg
        while True:
            todo, progressed = [], False
            for c in self.cells:
                for k in c.sweep.needed():
                    rec = load_record(cfg.out, RunKey(c.setting.label, c.method.name, *k), cfg.budget, cfg.eval_every)
                    if rec is None:
                        todo.append((c, k))
                    else:
                        c.sweep.results[k] = rec
                        self.reused += 1
                        progressed = True
            if not progressed:
                return todo

    def _job(self, c: Cell, k: tuple[float, int]) -> Job:
        return {"dirichlet": c.setting.dirichlet, "concurrency": c.setting.concurrency, "method": c.method.name,
                "value": k[0], "seed": k[1], "out": str(self.cfg.out), "budget": self.cfg.budget,
                "eval_every": self.cfg.eval_every}

    def run(self) -> None:
        if self.cfg.report_only:
            self._needed()
            for c in self.cells:
                c.sweep.choose_provisional()
            return
        pool = None
        if self.cfg.workers > 1:
            ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
            pool = ProcessPoolExecutor(self.cfg.workers, mp_context=ctx, initializer=worker_init, initargs=(1,))
        else:
            worker_init(1)
        try:
            while todo := self._needed():
                # The costly runs (many clients in flight) first, so the pool's processes end together.
                todo.sort(key=lambda ck: -ck[0].setting.concurrency)
                self._round(pool, todo)
        except BaseException:
            if pool is not None:  # interrupted: stop the runs in progress too (a run writes nothing partial)
                processes = list((getattr(pool, "_processes", None) or {}).values())
                pool.shutdown(wait=False, cancel_futures=True)
                for proc in processes:
                    proc.terminate()
            raise
        if pool is not None:
            pool.shutdown(wait=True)

    def _round(self, pool: ProcessPoolExecutor | None, todo: list[tuple[Cell, tuple[float, int]]]) -> None:
        if pool is None:
            for c, k in todo:
                self._finish(c, k, execute(self._job(c, k)))
            return
        futures = {pool.submit(execute, self._job(c, k)): (c, k) for c, k in todo}
        for fut in as_completed(futures):
            c, k = futures[fut]
            try:
                rec = fut.result()
            except Exception as exc:  # noqa: BLE001 - a worker process that died
                rec = {"error": f"{type(exc).__name__}: {exc}"}
            self._finish(c, k, rec)

    def _finish(self, c: Cell, k: tuple[float, int], rec: dict[str, Any]) -> None:
        label = f"{c.setting.label:<12}{c.method.name:<14}{c.method.knob_label()}={k[0]:<6g} seed={k[1]}"
        if "error" in rec:
            c.sweep.failed.add(k)
            self.failed.append(rec)
            print(f"{label}: FAILED {rec['error']}", flush=True)
            return
        c.sweep.results[k] = rec
        self.computed += 1
        self.gradients += int(rec.get("gradients", 0))
        if self.cfg.progress:
            print(f"[{self.computed + self.reused}/{self.planned()}] {label}  loss {rec['final_loss']:.4g}  "
                  f"acc {rec.get('accuracy', math.nan):.4f}{' (diverged)' if rec.get('diverged') else ''}  "
                  f"{rec.get('wall_total', 0.0):.1f} s", flush=True)


__all__ = ["SETTINGS", "Cell", "HalfDecadeSweep", "Runner", "execute", "half_step", "load_record"]
