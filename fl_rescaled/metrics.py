"""Run outputs: the progress bar, the metrics CSV and the loss-vs-time figure."""

from __future__ import annotations

import csv
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class ProgressBar:
    """A one-line progress bar on stderr, redrawn at most every 0.2 s."""

    def __init__(self, total: float, *, enabled: bool = True, label: str = "", width: int = 28) -> None:
        self.total = float(total)
        self.enabled = enabled
        self.label = label
        self.width = width
        self._last = 0.0
        self._t0 = time.perf_counter()

    def update(self, t: float, row: dict[str, Any] | None = None, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.2 and t < self.total:
            return
        self._last = now
        frac = min(max(t / self.total, 0.0), 1.0) if self.total > 0 else 1.0
        fill = int(round(frac * self.width))
        extra = ""
        if row:
            if "loss" in row:
                extra += f" loss={row['loss']:.4f}"
            if "updates" in row:
                extra += f" updates={row['updates']}"
        sys.stderr.write(
            f"\r{self.label:>15} [{'#' * fill}{'.' * (self.width - fill)}] "
            f"t={t:,.0f}/{self.total:,.0f}{extra} {now - self._t0:5.1f}s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self.update(self.total, force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()


def _cell(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return " ".join(_cell(x) for x in v)
    if isinstance(v, dict):
        return " ".join(f"{k}={_cell(x)}" for k, x in sorted(v.items()))
    if isinstance(v, float):
        return repr(v)
    return str(v)


def write_history_csv(path: str | Path, history: Sequence[dict[str, Any]]) -> Path:
    """One row per evaluation point; list-valued columns are space-separated."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols: list[str] = []
    for row in history:
        for k in row:
            if k not in cols:
                cols.append(k)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for row in history:
            w.writerow([_cell(row.get(c, "")) for c in cols])
    return path


def plot_curves(
    path: str | Path,
    curves: dict[str, Sequence[dict[str, Any]]],
    *,
    key: str = "loss",
    ylabel: str = "training loss",
    logy: bool = True,
    title: str = "",
) -> Path:
    """Plot ``key`` against time for each labelled history into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for label, hist in curves.items():
        pts = [(r["time"], r[key]) for r in hist if key in r]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label)
    ax.set_xlabel("time (simulated units)")
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
