#!/usr/bin/env python
"""The example app on 50 nodes, 12 training at a time: FedAvg against the asynchronous strategies.

The app is examples/quickstart-async, with its ClientApp unchanged (a FedAvg ClientApp: one local
epoch of SGD with momentum, lr 0.05, batch 32). It runs on 50 in-process nodes with
``fraction_train=0.25``. For FedAvg that means 12 sampled nodes per round. For the asynchronous
strategies it means 12 jobs in flight, and when one ends the next node is drawn from the idle ones.
Each node has 250 examples (200 to train), there is no federated evaluation, and the server
evaluates the final model on 2,000 MNIST test images. There are two comparisons:

  trainings  the same number of client trainings (default 120): FedAvg 10 rounds, FedBuff 120 / K
             updates, FedAsync and Rescaled ASGD 120 updates (each reply is one update)
  time       the same virtual time (default 48 units); FedAvg is then ``fedavg``, the engine's
             sampled synchronous rounds on the virtual clock (Flower's own FedAvg has no clock)

Each comparison runs on one of two populations:

  het    τ = 1, 1, 2, 2, 4, 4, 8, 8, 16, 16, five times over: heterogeneous speeds
  equal  every τ = 1: every job ends at the same instant as 11 others, and the population moves
         in lock-step

A strategy is named as in the registry, with ``fedbuff:K`` for FedBuff with buffer size K and
``flower-fedavg`` for Flower's own FedAvg. The script prints, for each strategy, the median over
the seeds and also the mean, min and max. A seed fixes the initial model and the draws: FedAvg's
node sampling (the ``random`` module) and the engine's selection. The same seed gives the same
numbers on the same machine. Float32 arithmetic differs in the last bits between CPU families,
so another machine can give slightly different accuracies.

    python benchmarks/bench_fifty_nodes.py [--seeds 10] [--population het|equal] [--examples 250]
        [--compare trainings|time] [--trainings 120] [--time 48]
        [--strategies flower-fedavg,fedbuff,fedbuff:4,fedasync,rescaled] [--json]

On 2 cores a run takes 3 to 4 s with 250 examples per node, and 6 s with 500.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_DIR = ROOT / "examples" / "quickstart-async"

NODES = 50
FRACTION_TRAIN = 0.25



def in_flight(nodes: int = NODES, fraction_train: float = FRACTION_TRAIN) -> int:
    """FedAvg's count of a round's nodes (min_train_nodes 2, at most every node): the jobs in flight."""
    return min(nodes, max(2, int(nodes * fraction_train)))


IN_FLIGHT = in_flight()  # 12


def population(kind: str, nodes: int = NODES) -> list[float]:
    """The nodes' compute times: ``het`` repeats τ = 1, 1, 2, 2, 4, 4, 8, 8, 16, 16; ``equal``: all 1."""
    return [1.0] * nodes if kind == "equal" else [2.0 ** ((i % 10) // 2) for i in range(nodes)]


HET_TAUS = population("het")
POPULATIONS = {"het": HET_TAUS, "equal": population("equal")}
DEFAULT_STRATEGIES = "flower-fedavg,fedbuff,fedbuff:4,fedasync,rescaled"


def parse_strategy(name: str) -> tuple[str, dict[str, Any]]:
    """``fedbuff:4`` → ("fedbuff", {"buffer_size": 4}); ``rescaled:lr=2`` → ("rescaled", {"lr": 2.0})
    (options as ``key=value``, separated by ``;``); any other name → (name, {})."""
    base, _, k = name.partition(":")
    if not k:
        return base, {}
    if "=" in k:
        options: dict[str, Any] = {}
        for item in k.split(";"):
            key, _, value = item.partition("=")
            try:
                options[key] = None if value == "none" else (int(value) if value.isdigit() else float(value))
            except ValueError:
                options[key] = value
        return base, options
    if base != "fedbuff" or not k.isdigit() or int(k) < 1:
        raise ValueError(f"{name!r}: only FedBuff takes a buffer size (fedbuff:K, K a positive integer)")
    return base, {"buffer_size": int(k)}


def budget_for(name: str, compare: str, trainings: int, virtual_time: float, jobs: int = IN_FLIGHT) -> dict[str, Any]:
    """The budget of ``start`` that gives ``name`` the comparison's amount of work."""
    base, options = parse_strategy(name)
    if compare == "time":
        if base == "flower-fedavg":
            raise ValueError("Flower's FedAvg has no virtual clock: compare it at equal trainings, or use fedavg")
        return {"time_budget": float(virtual_time)}
    if base in ("flower-fedavg", "fedavg"):
        per_step = jobs
    elif base == "fedbuff":
        from fl_rescaled.strategies.fedbuff import default_buffer

        per_step = options.get("buffer_size") or default_buffer(jobs)  # (its default for these jobs in flight)
    else:
        per_step = 1
    if trainings % per_step:
        raise ValueError(f"{trainings} trainings are not a whole number of {name}'s steps of {per_step}")
    steps = trainings // per_step
    return {"num_rounds": steps} if base == "flower-fedavg" else {"num_updates": steps}


def fifty_nodes(client_app, strategy: str, seed: int, taus: list[float] | None = None, examples: int = 250,
                nodes: int = NODES, fraction_train: float = FRACTION_TRAIN, **budget: Any) -> tuple[float, int]:
    """The example's ClientApp on 50 in-process nodes with ``fraction_train=0.25``. Returns the final
    central accuracy (2,000 test images) and the number of client trainings used: the replies applied
    (asynchronous strategies) or 12 per round (FedAvg). ``strategy`` is a name of ``parse_strategy``,
    ``taus`` the nodes' compute times (default: all 1), ``budget`` the keywords of ``start``.
    The caller puts the example on ``sys.path``."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from quickstart_async.server_app import central_evaluation
    from quickstart_async.task import Net

    from fl_rescaled import AsyncResult, run_inprocess
    from fl_rescaled.strategies import STRATEGIES

    base, options = parse_strategy(strategy)
    server = ServerApp()
    found: dict[str, Any] = {}

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        del context
        torch.manual_seed(seed)
        random.seed(seed)  # (Flower's FedAvg samples its nodes with the random module)
        keywords = {"fraction_train": fraction_train, "fraction_evaluate": 0.0}
        if base == "flower-fedavg":
            made = FedAvg(**keywords)
        else:
            made = STRATEGIES[base](**keywords, **options, **({"reply": "model"} if base == "rescaled" else {}))
        found["result"] = made.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                                     train_config=ConfigRecord({"lr": 0.05}), evaluate_fn=central_evaluation(2000),
                                     **budget)

    run_inprocess(server, client_app, nodes, app_dir=EXAMPLE_DIR,
                  run_config={"examples-per-client": examples, "fraction-evaluate": 0.0},
                  node_configs=[{"tau": t} for t in (taus or [1.0] * nodes)])
    result = found["result"]
    ev = result.evaluate_metrics_serverapp
    trainings = int(result.books["replies-accepted"]) if isinstance(result, AsyncResult) else in_flight(nodes, fraction_train) * max(ev)
    return float(ev[max(ev)]["accuracy"]), trainings


def summary(accuracies: list[float]) -> dict[str, float]:
    return {"median": statistics.median(accuracies), "mean": statistics.fmean(accuracies),
            "min": min(accuracies), "max": max(accuracies)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=10, help="seeds 0 .. N-1 (default 10)")
    p.add_argument("--population", choices=sorted(POPULATIONS), default="het")
    p.add_argument("--nodes", type=int, default=NODES, help=f"in-process nodes (default {NODES})")
    p.add_argument("--fraction-train", type=float, default=FRACTION_TRAIN,
                   help=f"FedAvg's fraction_train: the jobs in flight (default {FRACTION_TRAIN})")
    p.add_argument("--compare", choices=("trainings", "time"), default="trainings")
    p.add_argument("--trainings", type=int, default=120)
    p.add_argument("--time", type=float, default=48.0, help="virtual time units, with --compare time")
    p.add_argument("--examples", type=int, default=250, help="examples per node (the app's own default is 500)")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES)
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args = p.parse_args(argv)
    if args.seeds < 1 or args.trainings < 1 or not 0 < args.time < math.inf or args.examples < 2:
        p.error("--seeds, --trainings, --time and --examples must be positive")
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not 1 <= args.nodes <= 1000 or not 0 < args.fraction_train <= 1:
        p.error("--nodes must be in 1..1000 and --fraction-train in (0, 1]")
    for name in args.strategies:
        try:
            budget_for(name, args.compare, args.trainings, args.time, in_flight(args.nodes, args.fraction_train))
        except ValueError as exc:
            p.error(str(exc))
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import importlib

    import torch

    torch.set_num_threads(1)  # (tiny batches: one thread per job is fastest, as in the tests)
    client_app = importlib.import_module("quickstart_async.client_app").app
    rows = []
    for name in args.strategies:
        t0 = time.perf_counter()
        budget = budget_for(name, args.compare, args.trainings, args.time, in_flight(args.nodes, args.fraction_train))
        runs = [fifty_nodes(client_app, name, seed, population(args.population, args.nodes), args.examples,
                            args.nodes, args.fraction_train, **budget)
                for seed in range(args.seeds)]
        rows.append({"strategy": name, **summary([a for a, _ in runs]), "accuracies": [a for a, _ in runs],
                     "trainings": sorted({t for _, t in runs}), "seconds": time.perf_counter() - t0})
    return {"population": args.population, "nodes": args.nodes, "in_flight": in_flight(args.nodes, args.fraction_train),
            "compare": args.compare, "examples": args.examples, "seeds": args.seeds,
            "budget": args.trainings if args.compare == "trainings" else args.time, "rows": rows}


def table(out: dict[str, Any]) -> str:
    head = (f"{out['population']} population, {out['in_flight']} of {out['nodes']} nodes at a time, equal {out['compare']} ({out['budget']:g}), "
            f"{out['examples']} examples per node, seeds 0-{out['seeds'] - 1}")
    lines = [head, "", "| strategy | median | mean | min | max | trainings | s |", "|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        lines.append(f"| {r['strategy']} | {r['median']:.4f} | {r['mean']:.4f} | {r['min']:.4f} | {r['max']:.4f} | "
                     f"{','.join(map(str, r['trainings']))} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    for p in (str(EXAMPLE_DIR), str(ROOT)):
        if p not in sys.path:
            sys.path.insert(0, p)
    args = parse_args(argv)
    import logging

    import fl_rescaled  # noqa: F401  (Flower and Ray offline and quiet)

    for name in ("flwr", "fl_rescaled"):
        logging.getLogger(name).setLevel(logging.ERROR)
    out = measure(args)
    print(json.dumps(out, indent=1) if args.json else table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
