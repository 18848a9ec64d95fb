"""Run outputs: the progress bar, the metrics CSV and the loss-vs-time figure."""

from __future__ import annotations

import csv
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.control import Control, ControlType
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.segment import Segments


class ProgressBar:
    """A one-line progress bar on stderr, drawn with ``rich.progress`` (which ships with Flower).

    It draws only when ``enabled`` and stderr is a terminal, at most every 0.2 s; otherwise every
    call does nothing. ``update(t, row)`` moves it to ``t`` of ``total`` and shows the row's
    ``loss`` and ``updates``; ``close()`` draws it full and ends the line. The line is redrawn in
    place (no live display: the cursor stays visible, and a run that fails leaves the line as it
    was).
    """

    def __init__(self, total: float, *, enabled: bool = True, label: str = "", width: int = 28) -> None:
        self.total = float(total)
        self.label = label
        self.width = width
        self.enabled = enabled and sys.stderr.isatty()
        self._console = Console(file=sys.stderr) if self.enabled else None
        self._progress = Progress(
            TextColumn("{task.description:>15}"), BarColumn(bar_width=width),
            TextColumn("t={task.completed:,.0f}/{task.total:,.0f}{task.fields[extra]}"), TimeElapsedColumn(),
            console=self._console, auto_refresh=False)
        self._task = self._progress.add_task(label, total=self.total, extra="")
        self._last = 0.0

    def update(self, t: float, row: dict[str, Any] | None = None, force: bool = False) -> None:
        if not self.enabled:
            return
        extra = ""
        if row:
            if "loss" in row:
                extra += f" loss={row['loss']:.4f}"
            if "updates" in row:
                extra += f" updates={row['updates']}"
        fields = {"extra": extra} if row else {}
        self._progress.update(self._task, completed=min(max(t, 0.0), self.total), **fields)
        now = time.perf_counter()
        if force or t >= self.total or now - self._last >= 0.2:
            self._last = now
            line = self._console.render_lines(self._progress.make_tasks_table(self._progress.tasks), pad=False)[0]
            self._console.control(Control((ControlType.CARRIAGE_RETURN,), (ControlType.ERASE_IN_LINE, 2)))
            self._console.print(Segments(line), end="")

    def set_total(self, total: float) -> None:
        """The bar's end, once the run knows it (a budget in FedAvg's rounds, set at the start)."""
        self.total = float(total)
        self._progress.update(self._task, total=self.total)

    def close(self) -> None:
        if self.enabled:
            self.update(self.total, force=True)
            self._console.print()


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
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("figures need matplotlib: pip install 'fl-rescaled[plots]'") from exc

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
