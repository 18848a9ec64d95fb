"""The study's figures (matplotlib, Agg backend, PNG): training loss and cumulative stepsize
against time at each method's chosen α, and the iterates of the two toy problems."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .config import LABELS, METHODS
from .summaries import Band, Results
from .sweep import fmt_lr
from .toys import TOY2, Iterates, ToyResults, cycle_iterates

COLORS = {
    "rescaled": "tab:red",
    "malenia": "tab:blue",
    "ringleader": "tab:green",
    "vanilla": "tab:orange",
    "delay-adaptive": "tab:purple",
}


def _plt():
    import matplotlib  # heavy, and only the figures need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_figures(out: Path, res: Results, toys: ToyResults, tau_max: float) -> list[Path]:
    """Write every figure into ``out``; returns their paths (the MNIST ones only once a method has runs)."""
    figures = []
    if any(res.loss.values()):
        figures.append(out / "fig_loss_vs_time.png")
        fig_loss(figures[-1], {s: b for s, b in res.loss.items() if b}, res.tgrid, res.chosen, res.seeds)
        figures.append(out / "fig_cumulative_stepsize.png")
        medians = {s: {m: b[0] for m, b in c.items()} for s, c in res.cumstep.items() if c}
        fig_stepsize(figures[-1], medians, res.tgrid, res.chosen, tau_max)
    fp1, fp2 = toys.fixed_points("toy1"), toys.fixed_points("toy2")
    figures.append(out / "fig_toy1_inconsistency.png")
    fig_toy(figures[-1], toys.toys["toy1"], toys.iterates["toy1"], "τ=(1,2), α=0.01",
            [(fp1["equal"], f"x* = {fp1['equal']:.3g} (equal weights)"),
             (fp1["frequency"], f"x̃* = {fp1['frequency']:.3g} (frequency-weighted)")])
    figures.append(out / "fig_toy2_delay_adaptive.png")
    fig_toy(figures[-1], toys.toys["toy2"], toys.iterates["toy2"], f"τ=(1,100), α={TOY2['lr']:g}",
            [(fp2["equal"], "x* = 0"), (1.0, "fast worker's minimiser +1")])
    return figures


def fig_loss(path: Path, bands: dict[str, dict[str, Band]], tgrid: np.ndarray, chosen: dict, seeds: dict) -> None:
    """One panel per setting: median training loss over seeds, shaded from min to max, log scale."""
    plt = _plt()
    settings = list(bands)
    fig, axes = plt.subplots(1, len(settings), figsize=(5.2 * len(settings), 3.9), dpi=100, squeeze=False,
                             sharey=True)
    for ax, s in zip(axes[0], settings):
        for m, (med, lo, hi) in bands[s].items():
            ok = np.isfinite(med)
            ax.plot(tgrid[ok], med[ok], color=COLORS[m], lw=1.6,
                    label=f"{LABELS[m]} (α={fmt_lr(chosen[s][m])})")
            okb = np.isfinite(lo) & np.isfinite(hi)
            ax.fill_between(tgrid[okb], lo[okb], hi[okb], color=COLORS[m], alpha=0.18, lw=0)
        ax.set_yscale("log")
        n = seeds[s]
        ax.set_title(f"{s} compute times ({n} seed{'s' if n != 1 else ''}: median, min–max)", fontsize=10)
        ax.set_xlabel("time (simulated units)")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("training loss")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fig_stepsize(path: Path, cums: dict[str, dict[str, np.ndarray]], tgrid: np.ndarray, chosen: dict,
                 tau_max: float) -> None:
    """One panel per method: median cumulative stepsize vs time, fixed (solid) and exponential (dashed)."""
    plt = _plt()
    methods = [m for m in METHODS if any(m in c for c in cums.values())]
    fig, axes = plt.subplots(1, len(methods), figsize=(3.3 * len(methods), 3.3), dpi=100, squeeze=False)
    for ax, m in zip(axes[0], methods):
        refs: set[float] = set()
        for s, style in (("fixed", "-"), ("exponential", "--")):
            if m not in cums.get(s, {}):
                continue
            a = chosen[s][m]
            ax.plot(tgrid, cums[s][m], style, color=COLORS[m], lw=1.5, label=f"{s} (α={fmt_lr(a)})")
            if m == "rescaled" and a not in refs:  # the expected steady rate α/τ_max
                refs.add(a)
                ax.plot(tgrid, a / tau_max * tgrid, ":", color="k", lw=1, label=f"α·t/τ_max, α={fmt_lr(a)}")
        ax.set_title(LABELS[m], fontsize=10)
        ax.set_xlabel("time (simulated units)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("cumulative stepsize (median over seeds)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fig_toy(path: Path, toy: dict[str, Any], runs: dict[str, Iterates], title: str,
            lines: list[tuple[float, str]]) -> None:
    """Two panels: every iterate, and the iterate at the start of each τ_max-cycle; ``lines`` are
    horizontal references (value, label)."""
    plt = _plt()
    tau_max = max(toy["taus"])
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 3.9), dpi=100, sharey=True)
    for m, pts in runs.items():
        t, x = np.array(pts).T
        axes[0].plot(t, x, color=COLORS[m], lw=0.8, label=LABELS[m])
        ct, cx = np.array(cycle_iterates(pts, tau_max, toy["budget"])).T
        axes[1].plot(ct, cx, color=COLORS[m], lw=1.2, label=LABELS[m])
    for ax, what in zip(axes, ("all iterates", f"cycle iterates (every τ_max = {tau_max:g})")):
        for (y, lab), ls in zip(lines, ("--", ":")):
            ax.axhline(y, color="black", ls=ls, lw=0.9, label=lab)
        ax.set_xscale("symlog", linthresh=max(10 * tau_max, 10.0))
        ax.set_xlim(0, toy["budget"])
        ax.set_xlabel("time")
        ax.set_title(f"{title}: {what}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("x")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
