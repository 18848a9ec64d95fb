"""What a run looked like: every job of a sample of clients on a time axis, and the staleness of updates.

:class:`Timeline` is a manager observer. For a **sample** of clients (at most ``k``, 40 by default) it
keeps every job as a bar (client, start, end, outcome), the last ``max_bars`` per client; for **all**
accepted replies it counts their staleness δ (server updates applied since the job's model was sent)
in a histogram that grows with the largest δ seen. Its memory depends on the sample and on the
largest δ, never on the number of clients N; each event costs O(1).

A bar's outcome is ``applied`` (the reply passed validation and reached the strategy: the books'
``applied``, which a strategy may still buffer or discard), ``rejected``, ``lost``
(``fl_rescaled.manager.is_lost``), ``cancelled`` (the strategy stopped it) or ``in flight`` (still
running at the end of the run, drawn up to ``t_end``). The manager tells observers nothing when it
cancels a job; the timeline infers it (see :meth:`Timeline.bars`), or a caller reports it with
:meth:`Timeline.job_cancelled`.

:func:`plot_timeline` and :func:`plot_staleness` draw them (matplotlib is imported when they run);
:func:`client_table` and :func:`write_client_csv` give one row per client of the run's books.
"""

from __future__ import annotations

import csv
import math
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from .availability import Always, Daily, TraceAvailability
from .manager import Completion, Job, ManagerObserver, is_lost

#: Bar outcomes, in legend order, and their colors.
OUTCOMES = ("applied", "rejected", "lost", "cancelled", "in flight")
COLORS = {"applied": "#2a9d8f", "rejected": "#e63946", "lost": "#6c757d", "cancelled": "#f4a261",
          "in flight": "#a8dadc"}
APPLIED, REJECTED, LOST, CANCELLED, IN_FLIGHT = range(5)


class Timeline(ManagerObserver):
    """Jobs of sampled clients as bars, and the staleness histogram of every accepted reply.

    Parameters
    ----------
    clients : sequence of int
        The client (worker) ids to draw, one row each, in increasing order.
    max_bars : int
        The bars kept per client: the last ``max_bars`` (older ones are dropped and counted in
        ``dropped``).
    """

    def __init__(self, clients, *, max_bars: int = 2000) -> None:
        if max_bars < 1:
            raise ValueError(f"max_bars must be at least 1, got {max_bars}")
        self.clients = sorted({int(c) for c in clients})
        if any(c < 0 for c in self.clients):
            raise ValueError("client ids must be non-negative")
        self.max_bars = int(max_bars)
        self._row = {c: i for i, c in enumerate(self.clients)}
        self._bars: list[deque] = [deque(maxlen=self.max_bars) for _ in self.clients]
        self._open: list[dict[int, tuple[float, float]]] = [{} for _ in self.clients]  # job id -> (start, finish)
        self.dropped = [0] * len(self.clients)
        self._hist = np.zeros(16, np.int64)
        self.now = 0.0  # the time of the last completion seen

    @classmethod
    def sampled(cls, num_clients: int, k: int = 40, seed: int = 0, *, max_bars: int = 2000) -> Timeline:
        """A timeline of all clients when ``num_clients <= k``, else of ``k`` drawn without replacement
        by a generator seeded with ``seed`` (the same clients for the same arguments)."""
        n = int(num_clients)
        if n < 1 or k < 1:
            raise ValueError(f"num_clients and k must be positive, got {num_clients} and {k}")
        if n <= k:
            return cls(range(n), max_bars=max_bars)
        picked = np.random.default_rng((int(seed), 0x71E)).choice(n, size=k, replace=False)
        return cls(picked.tolist(), max_bars=max_bars)

    # ------------------------------------------------------------------ events
    def job_sent(self, job: Job) -> None:
        row = self._row.get(job.worker)
        if row is None:
            return
        start = job.start_time if job.start_time == job.start_time else job.dispatch_time
        opened = self._open[row]
        if opened:  # virtual clock: a job that starts before an open one ends means that one was cancelled
            for jid, (s, f) in list(opened.items()):
                if start < f:
                    del opened[jid]
                    self._add(row, s, max(s, min(f, job.dispatch_time)), CANCELLED)
        opened[job.job_id] = (start, job.finish_time)

    def completed(self, comp: Completion) -> None:
        if comp.ok:
            d = max(0, comp.delay)  # (δ = k − v is never negative)
            hist = self._hist
            if d >= hist.size:
                hist = self._hist = np.concatenate((hist, np.zeros(max(d + 1, 2 * hist.size) - hist.size, np.int64)))
            hist[d] += 1
        self.now = max(self.now, comp.time)
        row = self._row.get(comp.worker)
        if row is None:
            return
        job = comp.job
        start = self._open[row].pop(job.job_id, (job.start_time, 0.0))[0]
        if start != start:
            start = job.dispatch_time
        outcome = APPLIED if comp.ok else LOST if is_lost(comp.rejected) else REJECTED
        self._add(row, start, comp.time, outcome)

    def job_cancelled(self, job: Job, t: float | None = None) -> None:
        """``job`` was cancelled at time ``t`` (default: the last completion's time)."""
        row = self._row.get(job.worker)
        if row is not None and job.job_id in self._open[row]:
            s, f = self._open[row].pop(job.job_id)
            end = self.now if t is None else t
            self._add(row, s, max(s, min(f, end) if f == f else end), CANCELLED)

    def _add(self, row: int, start: float, end: float, outcome: int) -> None:
        bars = self._bars[row]
        if len(bars) == self.max_bars:
            self.dropped[row] += 1
        bars.append((start, end, outcome))

    # ------------------------------------------------------------------ readers
    def bars(self, t_end: float) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per sampled client (in ``clients`` order): its bars' starts, ends and outcome indices
        (into ``OUTCOMES``), sorted by start.

        The jobs still open are drawn up to ``t_end``: ``cancelled`` when the virtual clock had them
        finish by ``t_end`` (so they would have completed), else ``in flight`` (also every open job
        on the wall clock, where a job's finishing time is unknown until its reply comes).
        """
        out = []
        for row, bars in enumerate(self._bars):
            rows = list(bars)
            for s, f in self._open[row].values():
                rows.append((s, min(f, t_end), CANCELLED) if f <= t_end else (s, t_end, IN_FLIGHT))
            a = np.array(rows, np.float64).reshape(-1, 3)
            a = a[np.argsort(a[:, 0], kind="stable")]
            out.append((a[:, 0], a[:, 1], a[:, 2].astype(np.int64)))
        return out

    @property
    def histogram(self) -> np.ndarray:
        """``counts[δ]``: accepted replies of staleness δ, for δ = 0 .. the largest seen."""
        nz = np.flatnonzero(self._hist)
        return self._hist[: nz[-1] + 1 if nz.size else 0].copy()

    def staleness(self) -> dict[str, Any]:
        """``count``, ``mean``, ``p50``, ``p90``, ``p99`` and ``max`` of the staleness of the accepted
        replies (None when there were none). A quantile p is the smallest δ with at least a fraction
        p of the replies at or below it."""
        counts = self.histogram
        n = int(counts.sum())
        if n == 0:
            return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
        cum = np.cumsum(counts)
        q = {f"p{p}": int(np.searchsorted(cum, math.ceil(p / 100 * n))) for p in (50, 90, 99)}
        mean = float(np.dot(np.arange(counts.size, dtype=np.float64), counts) / n)
        return {"count": n, "mean": mean, **q, "max": int(counts.size - 1)}


# ---------------------------------------------------------------------- availability
def offline_time(model, t_end: float) -> np.ndarray:
    """Each client's offline time in [0, ``t_end``] under an availability model (vectorised for the
    project's models, else O(intervals) per client with ``next_on``/``next_off``)."""
    n, T = model.num_clients, float(t_end)
    if isinstance(model, Always):
        return np.zeros(n)
    if isinstance(model, Daily):
        # Online iff (t + φ) mod P < dP, so the online time in [0, s − φ] is G(s) − G(φ) with
        # G(s) = ⌊s/P⌋ · dP + min(s mod P, dP).
        p, phi, on = model._period, model._phase, model._on

        def g(s):
            k = np.floor(s / p)
            return k * on + np.minimum(s - k * p, on)

        return np.maximum(0.0, T - (g(T + phi) - g(phi)))
    if isinstance(model, TraceAvailability):
        starts, ends, offsets = model._starts[:-1], model._ends[:-1], model._offsets
        clipped = np.maximum(0.0, np.minimum(ends, T) - np.maximum(starts, 0.0))
        owner = np.repeat(np.arange(n), np.diff(offsets))
        return T - np.bincount(owner, weights=clipped, minlength=n)
    return np.array([sum(e - s for s, e in offline_intervals(model, c, T)) for c in range(n)])


def offline_intervals(model, client: int, t_end: float) -> list[tuple[float, float]]:
    """The (start, end) intervals in [0, ``t_end``] during which ``client`` is offline."""
    out, t = [], 0.0
    while t < t_end:
        on = model.next_on(client, t)
        if on > t:
            out.append((t, min(on, t_end)))
        if on >= t_end:
            break
        t = max(model.next_off(client, on), math.nextafter(on, math.inf))  # (always moves on)
    return out


# ---------------------------------------------------------------------- figures
def _figure(path: str | Path, size: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=size, dpi=100)
    return plt, fig, ax


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_timeline(path: str | Path, timeline: Timeline, *, t_end: float, availability=None, title: str = "") -> Path:
    """Draw the sampled clients' jobs (rows) against time into a PNG.

    Parameters
    ----------
    path : path
        The PNG to write.
    timeline : Timeline
    t_end : float
        The end of the time axis (the run's last time); jobs still open are drawn up to it.
    availability : Availability, optional
        Shades each row's offline time; None shades nothing.
    title : str
    """
    from matplotlib.patches import Patch

    rows = timeline.bars(t_end)
    nrows = max(1, len(rows))
    plt, fig, ax = _figure(path, (10.0, min(16.0, 1.5 + 0.22 * nrows)))
    total = sum(s.size for s, _, _ in rows)
    width = 0.3 if total < 5000 else 0.0
    colors = np.array([COLORS[o] for o in OUTCOMES])
    seen, shaded = set(), False
    for i, (client, (s, e, o)) in enumerate(zip(timeline.clients, rows)):
        if availability is not None:
            off = offline_intervals(availability, client, t_end)
            if off:
                shaded = True
                ax.broken_barh([(a, b - a) for a, b in off], (i - 0.5, 1.0), facecolors="#dddddd", zorder=0)
        if s.size:
            ax.broken_barh(np.column_stack((s, e - s)), (i - 0.4, 0.8), facecolors=colors[o],
                           edgecolors="white", linewidth=width, zorder=1)
            seen.update(o.tolist())
    handles = [Patch(color=COLORS[OUTCOMES[k]], label=OUTCOMES[k]) for k in sorted(seen)]
    if shaded:
        handles.append(Patch(color="#dddddd", label="offline"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([str(c) for c in timeline.clients], fontsize=7 if nrows > 20 else 9)
    ax.set_ylim(-0.6, nrows - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(0.0, t_end if t_end > 0 else 1.0)
    ax.set_xlabel("time (simulated units)")
    ax.set_ylabel("client")
    dropped = sum(timeline.dropped)
    ax.set_title(title + (f" (older {dropped} bars not kept)" if dropped else ""), fontsize=10)
    return _save(plt, fig, path)


def plot_staleness(path: str | Path, timeline: Timeline, *, title: str = "") -> Path:
    """Draw the histogram of the accepted replies' staleness δ, with its mean and p99, into a PNG
    (a log-scaled count axis when the counts span two decades or more)."""
    counts = timeline.histogram
    stats = timeline.staleness()
    plt, fig, ax = _figure(path, (6.4, 4.2))
    width = max(1, math.ceil(counts.size / 120))  # at most about 120 bars: δ grouped by ``width``
    if counts.size:
        padded = np.concatenate((counts, np.zeros(-counts.size % width, np.int64)))
        binned = padded.reshape(-1, width).sum(axis=1)
        keep = np.flatnonzero(binned)
        ax.bar(keep * width - 0.5, binned[keep], width=width, align="edge", color="#457b9d")
        ax.axvline(stats["mean"], color="#e63946", label=f"mean {stats['mean']:.3g}")
        ax.axvline(stats["p99"], color="#f4a261", linestyle="--", label=f"p99 {stats['p99']}")
        if binned[keep].max() >= 100 * binned[keep].min():
            ax.set_yscale("log")
        ax.legend()
    ax.set_xlabel("staleness δ (server updates since the job's model was sent)")
    ax.set_ylabel("accepted replies" + (f" per {width} values of δ" if width > 1 else ""))
    label = f"{stats['count']} accepted replies"
    ax.set_title(f"{title}: {label}" if title else label, fontsize=10)
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


# ---------------------------------------------------------------------- per-client table
def client_table(books, t_end: float, *, availability=None, busy=None) -> dict[str, list]:
    """One row per client of the run's books (a dict of equal-length columns).

    Parameters
    ----------
    books : fl_rescaled.manager.Books
    t_end : float
        The run's last time.
    availability : Availability, optional
        For ``offline_time`` in [0, t_end] (None: always online, 0).
    busy : array_like, optional
        Each client's compute time up to ``t_end``; without it the ``busy_time`` and ``idle_share``
        columns are left out.

    Returns
    -------
    dict of str to list
        ``client``, ``deliveries`` (server updates the client triggered), ``jobs_sent``, ``rejected``,
        ``lost``, ``discarded`` (cancelled or unused), ``in_flight``, ``busy_time``, ``idle_share``
        (1 − busy time / online time, 0 when never online) and ``offline_time``.
    """
    n = books.n
    offline = np.zeros(n) if availability is None else offline_time(availability, t_end)
    table: dict[str, list] = {
        "client": list(range(n)),
        "deliveries": books.updates.tolist(),
        "jobs_sent": books.jobs_sent.tolist(),
        "rejected": books.count("rejected").tolist(),
        "lost": books.count("lost").tolist(),
        "discarded": (books.count("cancelled") + books.count("unused")).tolist(),
        "in_flight": books.in_flight.tolist(),
    }
    if busy is not None:
        busy = np.asarray(busy, np.float64)
        if busy.shape != (n,):
            raise ValueError(f"busy must have one time per client ({n}), got shape {busy.shape}")
        online = float(t_end) - offline
        with np.errstate(divide="ignore", invalid="ignore"):
            idle = np.where(online > 0, np.clip(1.0 - busy / online, 0.0, 1.0), 0.0)
        table["busy_time"] = busy.tolist()
        table["idle_share"] = idle.tolist()
    table["offline_time"] = offline.tolist()
    return table


def write_client_csv(path: str | Path, table: dict[str, list]) -> Path:
    """Write :func:`client_table`'s columns as a CSV with a header row."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = list(table)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        w.writerows(zip(*(table[c] for c in cols)))
    return path


def write_run_figures(directory: str | Path, stem: str, timeline: Timeline, books, *, t_end: float,
                      availability=None, busy=None, title: str = "") -> dict[str, str]:
    """Write ``<stem>_timeline.png``, ``<stem>_staleness.png`` and ``<stem>_clients.csv`` in
    ``directory``; return their paths under the keys ``timeline_png``, ``staleness_png`` and
    ``clients_csv``."""
    d = Path(directory)
    return {
        "timeline_png": str(plot_timeline(d / f"{stem}_timeline.png", timeline, t_end=t_end,
                                          availability=availability, title=title)),
        "staleness_png": str(plot_staleness(d / f"{stem}_staleness.png", timeline, title=title)),
        "clients_csv": str(write_client_csv(d / f"{stem}_clients.csv",
                                            client_table(books, t_end, availability=availability, busy=busy))),
    }
