"""User-level DP on MNIST: the README's privacy-utility table and the figures of docs/privacy/.

The setting (``SETTING``): 1,000 clients (MNIST's training set cut into 1,000 Dirichlet(1) digit
mixes of 60 images), C = 100 of them training at a time, drawn uniformly from the idle ones, τ the
powers profile (1, 1, 2, 2, ..., 16, 16 repeating), every update clipped to ``CLIP``, 300 time units
(about 5,300 jobs: 5 per client on average). For each budget ε the noise multiplier z is the one
at which ``RELEASES`` releases of one update cost ε at δ = 1e-5 (``noise_for``), and
``--dp-target-epsilon ε`` stops each client there; ε = ∞ is the clip alone (z = 0, no budget).

    python scripts/privacy_mnist.py          # the runs, two at a time, niced: docs/privacy/mnist.json, figures
    python scripts/privacy_mnist.py --plot   # the figures again from docs/privacy/mnist.json

Each run is one ``run_sim.py`` command (``commands`` prints them); a run whose model diverges is
recorded as such (the divergence guard's ``RunFailed``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fl_rescaled.privacy import epsilon  # noqa: E402

OUT = ROOT / "docs" / "privacy"
CLIP = 0.05  # about the median norm of one minibatch gradient here (adaptive clipping's estimate at q = 0.5)
RELEASES = 5
DELTA = 1e-5
EPSILONS = (1.0, 4.0, 8.0, math.inf)
SETTING = ["--task", "mnist", "--num-clients", "1000", "--concurrency", "100", "--partition", "mix",
           "--dirichlet-alpha", "1", "--budget", "300", "--eval-every", "50", "--seed", "1",
           "--dp-clipping-norm", str(CLIP)]
METHODS = {
    "FedBuff (K = 100)": ["--strategy", "fedbuff", "--fedbuff-buffer-size", "100"],
    "FedAsync": ["--strategy", "fedasync"],
    "Rescaled ASGD": ["--strategy", "rescaled"],
}
#: The α each method runs with, the best of each cell reported (FedBuff does not use α: its clients'
#: local learning rate follows the α convention at α = 1).
ALPHAS = {"FedBuff (K = 100)": (1.0,), "FedAsync": (20.0, 150.0), "Rescaled ASGD": (20.0, 150.0)}
#: Only for the figure of ε over time (ε = 8): Rescaled ASGD with its steps from τ_i instead of p_i.
BY_TAU = ("Rescaled ASGD, by τ", ["--strategy", "rescaled", "--rescaled-by", "tau", "--lr", "20"])


def noise_for(eps: float, releases: int = RELEASES, delta: float = DELTA) -> float:
    """The smallest z (to 1e-4) at which ``releases`` releases of one update cost at most ``eps`` at ``delta``."""
    if math.isinf(eps):
        return 0.0
    lo, hi = 0.05, 500.0
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if epsilon({1: releases}, mid, delta) <= eps else (mid, hi)
    return math.ceil(hi * 1e4) / 1e4  # (rounded up: ``releases`` releases stay within ``eps``)


def argv_of(method: list[str], eps: float) -> list[str]:
    z = noise_for(eps)
    budget = [] if math.isinf(eps) else ["--dp-target-epsilon", f"{eps:g}"]
    return [*method, *SETTING, "--dp-noise-multiplier", f"{z:g}", *budget]


def runs(seed: int | None = None) -> list[tuple[str, float, list[str]]]:
    """Every run of the study: the table's cells (each α of each method, each ε) and, for the study's
    own seed only, the figure's run by τ. ``seed`` replaces the setting's seed (and leaves the figure's
    run out)."""
    out = [(name, eps, argv_of([*m, "--lr", f"{a:g}"], eps)) for name, m in METHODS.items() for a in ALPHAS[name]
           for eps in EPSILONS]
    if seed is None:
        return [*out, (BY_TAU[0], 8.0, argv_of(BY_TAU[1], 8.0))]
    def reseeded(argv: list[str]) -> list[str]:
        at = argv.index("--seed") + 1
        return [*argv[:at], str(seed), *argv[at + 1:]]

    return [(name, eps, reseeded(argv)) for name, eps, argv in out]


def table(results: list[dict[str, Any]]) -> list[str]:
    """Each cell's best α per seed, then the median and min–max over the seeds (diverged runs as 0.1,
    chance, and counted)."""
    import numpy as np  # noqa: PLC0415

    lines = ["| ε (every client) | " + " | ".join("∞" if math.isinf(e) else f"{e:g}" for e in EPSILONS) + " |",
             "|---|" + "---|" * len(EPSILONS)]
    seeds = sorted({r.get("seed", 1) for r in results})
    for name in METHODS:
        cells = []
        for eps in EPSILONS:
            key = None if math.isinf(eps) else eps
            accs, diverged = [], 0
            for sd in seeds:
                b = best([r for r in results if r.get("seed", 1) == sd], name, key)
                if b is None:
                    continue
                diverged += b["diverged"]
                accs.append(0.1 if b["diverged"] else b["accuracy"])
            cells.append("—" if not accs else f"{np.median(accs):.3f} [{min(accs):.3f} – {max(accs):.3f}]"
                         + (f" ({diverged} diverged)" if diverged else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def best(results: list[dict[str, Any]], name: str, eps: float | None) -> dict[str, Any] | None:
    """The cell's run with the highest accuracy over the α tried (a diverged one only if all did)."""
    rows = [r for r in results if r["method"] == name and r["epsilon"] == eps]
    return max(rows, key=lambda r: -1.0 if r["diverged"] else r["accuracy"], default=None)


def one(job: tuple[str, float, list[str]]) -> dict[str, Any]:
    """Run one command in this (niced) process; its accuracy, ε and the mean ε per τ over time."""
    name, eps, argv = job
    os.nice(10)
    import numpy as np  # noqa: PLC0415

    from fl_rescaled import cli, experiment  # noqa: PLC0415
    from fl_rescaled.errors import RunFailed  # noqa: PLC0415

    _, (spec,) = cli.parse(argv)
    row: dict[str, Any] = {"method": name, "epsilon": None if math.isinf(eps) else eps, "lr": spec.lr,
                           "command": "python run_sim.py " + " ".join(argv)}
    try:
        out = experiment.run(spec)
    except RunFailed as exc:
        return {**row, "diverged": True, "why": str(exc)[:200]}
    taus = np.array(out["taus"])
    hist = [h for h in out["history"] if "dp_epsilon_per_worker" in h]
    groups = {}
    for tau in (1.0, 16.0):
        mask = taus == tau
        groups[f"{tau:g}"] = [float(np.mean(np.array(h["dp_epsilon_per_worker"], float)[mask])) for h in hist]
    dp = out["dp"]
    return {**row, "diverged": False, "accuracy": out["accuracy"], "updates": out["num_updates"],
            "jobs": out["gradients"], "final_time": out["final_time"], "wall_seconds": out["wall_seconds"],
            "max_epsilon": dp["max_epsilon"], "mean_epsilon": dp["mean_epsilon"], "excluded": len(dp["excluded"]),
            "noise_multiplier": dp["noise_multiplier"], "times": [h["time"] for h in hist],
            "mean_epsilon_by_tau": groups}


def plot(results: list[dict[str, Any]]) -> list[Path]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    for name in METHODS:
        rows = [best(results, name, e) for e in (1.0, 4.0, 8.0, None)]
        rows = [r for r in rows if r is not None]
        finite = [(r["epsilon"], r["accuracy"]) for r in rows if r["epsilon"] is not None and not r["diverged"]]
        free = [r for r in rows if r["epsilon"] is None and not r["diverged"]]
        line, = ax.plot([e for e, _ in finite], [a for _, a in finite], "o-", label=name)
        for r in rows:
            if r["diverged"] and r["epsilon"] is not None:  # (at chance level, marked)
                ax.plot([r["epsilon"]], [0.1], "x", color=line.get_color(), ms=8)
                ax.annotate("diverged", (r["epsilon"], 0.1), textcoords="offset points", xytext=(6, -3), fontsize=7)
        if free:
            ax.axhline(free[0]["accuracy"], ls=":", color=line.get_color(), lw=1)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks([1, 4, 8], ["1", "4", "8"])
    first = _save(plt, fig, ax, "mnist_accuracy_vs_epsilon.png", "ε per client (δ = 1e-5); dotted: ε = ∞ (clip only)",
                  "test accuracy (best α of each cell)", "MNIST, 1,000 clients, C = 100, 300 time units, seed 1")

    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    styles = {"1": "-", "16": "--"}
    shown = [r for r in results if r["epsilon"] == 8.0 and not r["diverged"] and r["method"] != "FedAsync"
             and r["lr"] in (None, 1.0, 20.0)]
    for r, width in zip(shown, (1.5, 4.0, 1.2)):
        color = None
        for tau, values in r["mean_epsilon_by_tau"].items():
            line, = ax.plot(r["times"], values, styles[tau], color=color, lw=width, label=f"{r['method']}, τ = {tau}")
            color = line.get_color()
    ax.axhline(8.0, color="k", lw=0.8, ls=":")
    second = _save(plt, fig, ax, "mnist_epsilon_over_time.png", "time", "mean ε of the clients with that τ",
                   "budget ε = 8 (dotted), MNIST, 1,000 clients, C = 100, seed 1")
    return [first, second]


def _save(plt: Any, fig: Any, ax: Any, name: str, xlabel: str, ylabel: str, title: str) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / name, dpi=90)
    plt.close(fig)
    return OUT / name


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", action="store_true", help="only redraw the figures from docs/privacy/mnist.json")
    parser.add_argument("--commands", action="store_true", help="print the run_sim.py commands and exit")
    parser.add_argument("--seeds", help="only the table's runs, once per seed of this list (e.g. 1,2,3,4,5), "
                        "into --results; then the table of medians and min–max over the seeds")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2)")
    parser.add_argument("--results", help="with --seeds: the JSON file of the runs (default docs/privacy/mnist_seeds.json)")
    args = parser.parse_args(argv)
    path = OUT / "mnist.json"
    if args.commands:
        for name, eps, cmd in runs():
            print(f"# {name}, ε = {eps:g}\npython run_sim.py {' '.join(cmd)}")
        return
    if args.seeds:
        seeds = [int(x) for x in args.seeds.split(",")]
        jobs = [(sd, job) for sd in seeds for job in runs(sd)]
        out = Path(args.results) if args.results else OUT / "mnist_seeds.json"
        done: list[dict[str, Any]] = []
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:  # (written as they end: a cut-off study keeps its runs)
            futures = {pool.submit(one, job): sd for sd, job in jobs}
            for future in as_completed(futures):
                done.append({**future.result(), "seed": futures[future]})
                out.write_text(json.dumps(done, indent=1) + "\n")
        print("\n".join(table(done)))
        return
    if not args.plot:
        with ProcessPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(one, runs()))
        path.write_text(json.dumps(results, indent=1) + "\n")
    results = json.loads(path.read_text())
    for r in results:
        acc = "diverged" if r["diverged"] else f"{r['accuracy']:.3f}"
        eps = r["epsilon"] or math.inf
        print(f"{r['method']:24s} α={r['lr']!s:6s} ε={eps:<4g} z={noise_for(eps):<8g} {acc}")
    for p in plot(results):
        print("wrote", p.relative_to(ROOT))


if __name__ == "__main__":
    main()
