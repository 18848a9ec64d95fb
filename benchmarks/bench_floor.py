#!/usr/bin/env python
"""How fast could the paper study be on this machine? Floors from its stored runs and kernel timings.

For every stored run of a study folder (default: the committed ``docs/paper``) it counts the work
that no engine can skip: the minibatch gradients the workers computed and the evaluations of the
training loss (54,210 images) and test accuracy (10,000 images). Then it times, in this process
on one torch thread (the study's setting):

- the bare MLP step (``paper.bare_loop_rate``: the hand-written gradient and an in-place step);
- one evaluation (``MnistTask.evaluate``);
- a large square float32 matrix product, the machine's practical peak;
- the first layer's product for one minibatch (64×784 by 784×128), alone and for 5 replicas stacked
  (784×640): what batching replicas that share a minibatch can gain in the matrix products.

and prints, per stage (sweeps, five-seed stage) and for the whole study, with ``--workers``
processes in parallel and perfect balance:

- kernel floor: the study with zero engine overhead, every gradient at the bare loop's speed and
  every evaluation at its measured time;
- FLOP floor: the study's multiply-adds at the peak matrix-product speed (no kernel is faster).

next to the measured wall time of the committed study and the issue's targets.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_floor.py [--study docs/paper] [--workers 2]
"""

from __future__ import annotations

import fl_rescaled  # noqa: F401  (first: Flower and Ray offline, fl_rescaled.OFFLINE_ENV)

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

BATCH = 64
H, D, C = 128, 784, 10
TRAIN, TEST = 54210, 10000
# Multiply-adds × 2: forward of both layers, the two weight gradients and the hidden-layer gradient.
GRAD_FLOPS = 2 * BATCH * (D * H + H * C) + 2 * BATCH * (D * H + H * C) + 2 * BATCH * H * C
EVAL_FLOPS = 2 * (TRAIN + TEST) * (D * H + H * C)
TARGETS = {"seed stage": 25 * 60.0, "whole study": 90 * 60.0}


def stage_counts(study: Path) -> dict[str, dict[str, float]]:
    """Runs, gradients, evaluations and summed per-run wall seconds per stage of a stored study."""
    chosen = json.loads((study / "summary.json").read_text())["chosen"]
    stages = {s: {"runs": 0, "gradients": 0, "evaluations": 0, "wall": 0.0} for s in ("sweeps", "seed stage")}
    for path in sorted((study / "runs").rglob("*.json")):
        rec = json.loads(path.read_text())
        stage = "seed stage" if rec["lr"] == chosen[rec["delays"]].get(rec["strategy"]) else "sweeps"
        c = stages[stage]
        c["runs"] += 1
        # The first records (Rescaled, one applied update per gradient) predate the field.
        c["gradients"] += rec.get("gradients", rec["num_updates"])
        c["evaluations"] += round(rec["budget"] / rec["eval_every"]) + 1
        c["wall"] += rec["wall_seconds"]
    stages["whole study"] = {k: stages["sweeps"][k] + stages["seed stage"][k] for k in stages["sweeps"]}
    return stages


def eval_seconds(repeats: int) -> float:
    from fl_rescaled.tasks import get_task

    task = get_task({"task": "mnist", "seed": 0, "num-partitions": 10, "batch-size": 64, "dirichlet-alpha": 0.0})
    x = task.initial_params(0)
    task.evaluate(x)  # loads the data
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        task.evaluate(x)
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_gflops(m: int, k: int, n: int, calls: int, repeats: int = 3) -> float:
    """Best rate of ``calls`` products (m×k) @ (k×n), the second stored transposed as a model's layer."""
    a, b = torch.randn(m, k), torch.randn(n, k)
    c = torch.empty(m, n)
    torch.mm(a, b.t(), out=c)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b.t(), out=c)
        best = min(best, (time.perf_counter() - t0) / calls)
    return 2 * m * k * n / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "paper")
    ap.add_argument("--workers", type=int, default=2, help="processes of the study (one thread each)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from fl_rescaled.paper import bare_loop_rate

    stages = stage_counts(args.study)
    bare = max(bare_loop_rate(3.0) for _ in range(2))
    t_eval = eval_seconds(5)
    peak = gemm_gflops(2048, 2048, 2048, 1, 5)
    layer = gemm_gflops(BATCH, D, H, 2000)
    stacked = gemm_gflops(BATCH, D, 5 * H, 400)
    rows = {}
    for name, c in stages.items():
        kernel = (c["gradients"] / bare + c["evaluations"] * t_eval) / args.workers
        flops = c["gradients"] * GRAD_FLOPS + c["evaluations"] * EVAL_FLOPS
        rows[name] = {**c, "tflop": flops / 1e12, "eval_share_of_flops": c["evaluations"] * EVAL_FLOPS / flops,
                      "kernel_floor_s": kernel, "flop_floor_s": flops / (peak * 1e9 * args.workers),
                      "measured_s": c["wall"] / args.workers, "target_s": TARGETS.get(name)}
    report = {"torch": torch.__version__, "threads": 1, "workers": args.workers, "bare_steps_per_s": bare,
              "eval_seconds": t_eval, "eval_gflops": EVAL_FLOPS / t_eval / 1e9,
              "bare_gflops": GRAD_FLOPS * bare / 1e9, "peak_gflops": peak, "layer_gflops": layer,
              "stacked_layer_gflops": stacked, "stages": rows}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"torch {torch.__version__}, 1 thread per process, {args.workers} processes; study: {args.study}")
    print(f"bare MLP step {bare:.0f} steps/s ({report['bare_gflops']:.1f} GFLOP/s); one evaluation "
          f"{t_eval:.3f} s ({report['eval_gflops']:.1f} GFLOP/s); 2048² matrix product {peak:.1f} GFLOP/s")
    print(f"first-layer product of one minibatch: {layer:.1f} GFLOP/s alone, {stacked:.1f} GFLOP/s for 5 "
          f"replicas stacked (ratio {stacked / layer:.2f})")
    print(f"{'':<12}{'runs':>5}{'gradients':>12}{'evals':>7}{'TFLOP':>7}{'eval %':>7}"
          f"{'FLOP floor':>12}{'kernel floor':>14}{'measured':>10}{'target':>8}")
    for name, r in rows.items():
        tgt = f"{r['target_s'] / 60:.0f} min" if r["target_s"] else "—"
        print(f"{name:<12}{r['runs']:>5}{r['gradients']:>12,}{r['evaluations']:>7}{r['tflop']:>7.0f}"
              f"{100 * r['eval_share_of_flops']:>6.0f}%{r['flop_floor_s'] / 60:>8.1f} min{r['kernel_floor_s'] / 60:>10.1f} min"
              f"{r['measured_s'] / 60:>6.0f} min{tgt:>8}")
    print("measured = sum of the stored runs' wall seconds / processes (a batched run's share of its batch).")


if __name__ == "__main__":
    main()
