"""The study's figures: one PNG per setting, test accuracy and training loss against virtual time for
every method at its chosen value (median over seeds, shaded from min to max)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fl_rescaled.paper.figures import _plt

from .config import RATE, PopulationConfig
from .results import Results

COLORS = {"fedavg": "tab:gray", "fedbuff": "tab:purple", "fedasync": "tab:green", "vanilla": "tab:orange",
          "rescaled-tau": "tab:blue", "rescaled-rate": "tab:red"}


def draw_figures(cfg: PopulationConfig, res: Results) -> list[Path]:
    """``out/fig_<setting>.png`` for every setting with runs; returns the paths."""
    paths = []
    for s in cfg.settings:
        bands = res.curves.get(s.label)
        if not bands:
            continue
        path = cfg.out / f"fig_{s.label}.png"
        plt = _plt()
        fig, axes = plt.subplots(1, 2, figsize=(10.4, 3.8), dpi=90)
        for m in cfg.methods:
            if m.name not in bands:
                continue
            value = res.chosen[s.label][m.name]
            n = res.summary[s.label][m.name]["n"]
            for ax, key in zip(axes, ("accuracy", "loss")):
                med, lo, hi = bands[m.name][key]
                ok = np.isfinite(med)
                # (dashed: where Rescaled(rate) runs as Rescaled(τ), C = N, the two curves are one)
                ax.plot(res.tgrid[ok], med[ok], color=COLORS[m.name], lw=1.5, ls="--" if m.name == RATE else "-",
                        label=f"{m.label} ({m.knob_label()}={value:g}, {n} seed{'s' if n != 1 else ''})")
                okb = np.isfinite(lo) & np.isfinite(hi)
                ax.fill_between(res.tgrid[okb], lo[okb], hi[okb], color=COLORS[m.name], alpha=0.15, lw=0)
        axes[0].set_ylabel("test accuracy")
        axes[1].set_ylabel("training loss (equal-weight objective)")
        axes[1].set_yscale("log")
        for ax in axes:
            ax.set_xlabel("virtual time")
            ax.grid(alpha=0.3, which="both")
        axes[0].legend(fontsize=7, loc="lower right")
        fig.suptitle(f"{s.title}: median over seeds, min–max shaded", fontsize=10)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
