#!/usr/bin/env python
"""Seconds per applied update: our app on the in-process Grid and on Flower's Simulation Engine,
against a bare Flower push/pull round trip on the same engine.

  (a) in-process  ``experiment.run(spec)`` on the in-process Grid
  (b) flower      ``experiment.run(spec, grid)`` as the ServerApp of a Flower simulation (Ray)
  (c) bare        a ServerApp that pushes one small message (8 floats) to one node and polls for
                  the reply every 2 ms (our manager's interval), N times; the ClientApp answers at once

The spec is a small quadratic task. "q3": 3 clients, τ = 1, 2, 4 (fixed). "q1": 1 client, so
every update is one full round trip (our stack's price per message on the engine). All (b) and
(c) measurements share one simulation and are interleaved (q3, q1, bare, q3, ...) so machine
noise hits them alike. Time per update is taken between applied updates (timestamps of
``AsyncClientManager.record_update``), after ``--warmup`` updates: Ray's start-up, the actors'
cold start and the hello query are excluded.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_engines.py \
        [--updates 150] [--repeats 2] [--warmup 10] [--json]
"""

from __future__ import annotations

import fl_rescaled  # noqa: F401  (first: Flower and Ray offline, fl_rescaled.OFFLINE_ENV)

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # Flower passes sys.path on to the Ray workers

import numpy as np  # noqa: E402
from flwr.app import ArrayRecord, Context, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from fl_rescaled.clients.client_app import app as project_client_app  # noqa: E402
from fl_rescaled.manager import ManagerObserver  # noqa: E402
from fl_rescaled.experiment import RunSpec, run  # noqa: E402
from fl_rescaled.flower_sim import simulate  # noqa: E402

POLL = 0.002  # seconds: AsyncClientManager's poll interval

Q3 = RunSpec(task="quadratic", strategy="rescaled", lr=0.1, taus=[1.0, 2.0, 4.0], quad_dim=10, noise=0.1, seed=0)
Q1 = RunSpec(task="quadratic", strategy="rescaled", lr=0.1, taus=[1.0], quad_dim=10, noise=0.1, seed=0)


def sized(spec: RunSpec, n_updates: int) -> RunSpec:
    """``spec`` with a budget that gives about ``n_updates`` updates (rate Σ 1/τ_i), evaluated only at the ends."""
    rate = sum(1.0 / t for t in spec.taus or [1.0])
    budget = n_updates / rate
    return replace(spec, budget=budget, eval_every=budget)


# -------------------------------------------------------------------- instrumentation
class Probe(ManagerObserver):
    """Timestamps of applied updates and the time spent waiting for replies (virtual clock), from
    the client manager's observer hook."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.waits: list[float] = []

    def update_applied(self, worker: int, stepsize: float, version: int) -> None:
        self.stamps.append(time.perf_counter())

    def reply_awaited(self, job, seconds: float) -> None:
        self.waits.append(seconds)

    def per_update(self, warmup: int) -> dict[str, float]:
        s = self.stamps[warmup:]
        if len(s) < 2:
            raise RuntimeError(f"only {len(self.stamps)} updates; raise --updates")
        gaps = np.diff(s)
        waits = self.waits[warmup:]
        return {
            "updates": len(s) - 1,
            "s_per_update": (s[-1] - s[0]) / (len(s) - 1),
            "median_gap": float(np.median(gaps)),
            "share_waiting": sum(1 for w in waits if w > 0.005) / max(len(waits), 1),
        }


def measure_run(spec: RunSpec, warmup: int, grid=None) -> dict[str, float]:
    probe = Probe()
    out = run(spec, grid=grid, observers=[probe])
    res = probe.per_update(warmup)
    res["num_updates"] = out["num_updates"]
    return res


# -------------------------------------------------------------------- bare round trips
bench_client = ClientApp()


@bench_client.train()
def _train(msg: Message, context: Context) -> Message:
    return project_client_app(msg, context)


@bench_client.query("hello")
def _hello(msg: Message, context: Context) -> Message:
    return project_client_app(msg, context)


@bench_client.query("ping")
def _ping(msg: Message, context: Context) -> Message:
    del context
    return Message(RecordDict({"pong": ArrayRecord([np.zeros(8)])}), reply_to=msg)


def bare_round_trips(grid, n: int, warmup: int) -> dict[str, float]:
    node = sorted(int(x) for x in grid.get_node_ids())[0]
    times: list[float] = []
    for _ in range(n + warmup):
        t0 = time.perf_counter()
        msg = Message(RecordDict({"ping": ArrayRecord([np.zeros(8)])}), node, "query.ping", ttl=120.0)
        (mid,) = grid.push_messages([msg])
        while True:
            replies = list(grid.pull_messages([mid]))
            if replies:
                break
            time.sleep(POLL)
        if replies[0].has_error():
            raise RuntimeError(f"ping failed: {replies[0].error.reason}")
        times.append(time.perf_counter() - t0)
    t = times[warmup:]
    return {"updates": len(t), "s_per_update": float(np.mean(t)), "median_gap": float(np.median(t)),
            "share_waiting": 1.0}


# -------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=150, help="measured updates (round trips) per repeat on Flower")
    ap.add_argument("--inprocess-updates", type=int, default=5000, help="updates per repeat on the in-process Grid")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logging.getLogger("fl_rescaled").setLevel(logging.ERROR)
    w = args.warmup
    rows: dict[str, list[dict[str, float]]] = {"a_q3": [], "b_q3": [], "b_q1": [], "c_bare": []}

    for _ in range(args.repeats):
        rows["a_q3"].append(measure_run(sized(Q3, args.inprocess_updates + w), w))

    def server_main(grid, context) -> None:
        for _ in range(args.repeats):
            rows["b_q3"].append(measure_run(sized(Q3, args.updates + w), w, grid))
            rows["b_q1"].append(measure_run(sized(Q1, args.updates + w), w, grid))
            rows["c_bare"].append(bare_round_trips(grid, args.updates, w))

    t0 = time.perf_counter()
    simulate(server_main, num_supernodes=3, client_app=bench_client, num_cpus=args.num_cpus)
    sim_seconds = time.perf_counter() - t0

    best = {k: min(v, key=lambda r: r["s_per_update"]) for k, v in rows.items()}
    med = {k: statistics.median(r["s_per_update"] for r in v) for k, v in rows.items()}
    c = med["c_bare"]
    summary = {
        "per_update_median_s": med,
        "per_update_best_s": {k: r["s_per_update"] for k, r in best.items()},
        "share_of_updates_waiting_for_engine": {k: statistics.median(r["share_waiting"] for r in v)
                                                for k, v in rows.items()},
        "ratio_b_q3_over_c": med["b_q3"] / c,
        "ratio_b_q1_over_c": med["b_q1"] / c,
        "ratio_b_q3_over_a": med["b_q3"] / med["a_q3"],
        "repeats": args.repeats,
        "updates": args.updates,
        "simulation_seconds": sim_seconds,
    }
    if args.json:
        print(json.dumps(summary))
        return
    labels = {
        "a_q3": "(a) in-process Grid, q3 (3 clients, τ=1,2,4)",
        "b_q3": "(b) Flower Simulation Engine, q3",
        "b_q1": "(b1) Flower Simulation Engine, q1 (1 client)",
        "c_bare": "(c) bare Flower push/pull round trip, 2 ms poll",
    }
    print(f"{'':52s} {'s/update (median)':>18s} {'best':>10s} {'waiting':>8s}")
    for k, label in labels.items():
        share = summary["share_of_updates_waiting_for_engine"][k]
        print(f"{label:52s} {med[k]:18.6f} {best[k]['s_per_update']:10.6f} {share:8.0%}")
    print(f"(b)/(c)  q3: {summary['ratio_b_q3_over_c']:.3f}   q1: {summary['ratio_b_q1_over_c']:.3f}   "
          f"(b)/(a) q3: {summary['ratio_b_q3_over_a']:.0f}x")
    print(f"{args.repeats} repeats, {args.updates} measured updates each on Flower "
          f"({args.inprocess_updates} in process); simulation {sim_seconds:.1f} s incl. Ray start-up")


if __name__ == "__main__":
    main()
