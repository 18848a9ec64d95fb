"""The run's timeline (jobs of sampled clients as bars), its staleness histogram and per-client table."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
from conftest import quad

from fl_rescaled.availability import Always, Daily, TraceAvailability
from fl_rescaled.experiment import RunSpec, run
from fl_rescaled.manager import Books, Completion, Job, OnEvent
from fl_rescaled.timeline import (OUTCOMES, Timeline, client_table, offline_intervals, offline_time, plot_staleness,
                                  plot_timeline, write_client_csv)

QUAD = {"quad_a": [1.0, 1.0, 1.0], "quad_b": [0.0, 1.0, 2.0], "lr": 0.05, "budget": 30}


def watched(observers, **kw):
    """A quadratic-task run with ``observers`` registered."""
    return run(RunSpec(task="quadratic", **kw), observers=observers)


def code(name: str) -> int:
    return OUTCOMES.index(name)


def read_csv(path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_run_writes_figures_and_a_row_per_client(tmp_path):
    out = quad(strategy="malenia", taus=[1, 2, 3], **QUAD, out=str(tmp_path))
    for key in ("timeline_png", "staleness_png"):
        assert out[key].endswith(f"_{key.split('_')[0]}.png") and (tmp_path / out[key]).stat().st_size > 1000
    rows = read_csv(out["clients_csv"])
    assert [int(r["client"]) for r in rows] == [0, 1, 2]
    assert [int(r["deliveries"]) for r in rows] == out["updates_per_worker"]
    assert [int(r["discarded"]) for r in rows] == out["discarded_per_worker"]
    sent = out["books"]["sent-per-worker"]
    assert [int(r["jobs_sent"]) for r in rows] == sent
    assert [float(r["offline_time"]) for r in rows] == [0.0, 0.0, 0.0]
    # Every client computes all the time on the virtual clock (Malenia restarts at once).
    assert [float(r["busy_time"]) for r in rows] == pytest.approx([30.0] * 3)
    assert [float(r["idle_share"]) for r in rows] == pytest.approx([0.0] * 3, abs=1e-12)
    assert set(out["staleness"]) == {"count", "mean", "p50", "p90", "p99", "max"}


def test_without_out_the_outcome_still_has_the_staleness():
    out = quad(strategy="rescaled", taus=[1, 2], quad_a=[1.0, 1.0], quad_b=[0.0, 1.0], lr=0.05, budget=10)
    assert out["staleness"]["count"] == out["num_updates"] and "timeline_png" not in out


def test_rescaled_bars_have_length_tau_and_no_gaps():
    taus = [1.0, 2.0, 4.0]
    tl = Timeline(range(3))
    out = watched([tl], strategy="rescaled", taus=taus, **QUAD)
    t_end = out["final_time"]
    assert t_end == 30
    for i, (start, end, outcome) in enumerate(tl.bars(t_end)):
        applied = outcome == code("applied")
        assert applied.sum() == out["updates_per_worker"][i] == math.floor(30 / taus[i])
        assert set(outcome[~applied].tolist()) <= {code("in flight")} and (~applied).sum() == 1
        assert np.array_equal(end[applied] - start[applied], np.full(applied.sum(), taus[i]))
        assert start[0] == 0.0 and end[-1] == t_end
        assert np.array_equal(start[1:], end[:-1])  # back to back: always busy


def test_malenia_cancelled_jobs_show_as_cancelled():
    tl = Timeline(range(3))
    out = watched([tl], strategy="malenia", taus=[1, 2, 3.5], **QUAD)
    rows = tl.bars(out["final_time"])
    for i, (start, end, outcome) in enumerate(rows):
        cancelled = outcome == code("cancelled")
        assert cancelled.sum() == out["discarded_per_worker"][i]
        # A round closes when the slowest client (τ = 3.5) delivers: the others' jobs stop there.
        closes = end[cancelled] / 3.5
        assert np.allclose(closes, np.round(closes)) and (end[cancelled] > start[cancelled]).all()
        assert np.array_equal(start[1:], end[:-1])  # the next round's job starts when the old one stops
    assert out["discarded_per_worker"][:2] == [8, 8] and out["discarded_per_worker"][2] == 0


def test_staleness_histogram_matches_the_completions():
    delays: list[int] = []
    record = OnEvent(lambda comp, x: delays.append(comp.delay) if comp.ok else None)
    tl = Timeline([0])
    out = watched([record, tl], strategy="rescaled", taus=[1.0, 1.5, 3.0, 7.0], delays="exponential",
                  quad_a=[1.0] * 4, quad_b=[0.0, 1.0, 2.0, 3.0], lr=0.05, budget=200)
    counts = tl.histogram
    assert counts.sum() == out["num_updates"] == len(delays)
    assert np.array_equal(counts, np.bincount(delays))
    s = tl.staleness()
    assert s["mean"] == pytest.approx(np.mean(delays), rel=1e-12)
    for p in (50, 90, 99):
        assert s[f"p{p}"] == int(np.percentile(delays, p, method="inverted_cdf"))
    assert s["max"] == max(delays) and s["count"] == len(delays)
    assert out["staleness"] == s  # the runner's own timeline saw the same completions


def test_sample_is_deterministic_and_bounded():
    a = Timeline.sampled(5000, seed=3)
    assert len(a.clients) == 40 and a.clients == sorted(set(a.clients)) and 0 <= a.clients[0] < a.clients[-1] < 5000
    assert a.clients == Timeline.sampled(5000, seed=3).clients != Timeline.sampled(5000, seed=4).clients
    assert Timeline.sampled(25, seed=3).clients == list(range(25))
    assert len(Timeline.sampled(5000, k=7).clients) == 7
    with pytest.raises(ValueError):
        Timeline.sampled(0)


def job(worker: int, jid: int, start: float, finish: float = math.nan, version: int = 0) -> Job:
    return Job(jid, worker, version, 0, start, start_time=start, finish_time=finish)


def test_bars_per_client_are_capped_and_others_are_not_kept():
    tl = Timeline([1], max_bars=5)
    for k in range(20):
        for w in (0, 1, 2):
            j = job(w, 3 * k + w, float(k), float(k + 1))
            tl.job_sent(j)
            tl.completed(Completion(j, float(k + 1), delay=w))
    start, end, outcome = tl.bars(20.0)[0]
    assert start.tolist() == [15.0, 16.0, 17.0, 18.0, 19.0] and tl.dropped == [15]
    assert tl.histogram.tolist() == [20, 20, 20]  # every client's replies count
    assert tl._open == [{}]


def test_outcomes_of_failed_and_open_jobs():
    tl = Timeline([0])
    reasons = [None, "non-finite", "error-code-5", "ttl-expired", "malformed"]
    for k, reason in enumerate(reasons):
        j = job(0, k, float(k), float(k + 1))
        tl.job_sent(j)
        tl.completed(Completion(j, float(k + 1), delay=0, rejected=reason))
    tl.job_sent(job(0, 10, 5.0, 7.0))  # finishes by t_end: it would have completed, so it was cancelled
    tl.job_sent(job(0, 11, 7.0, 9.0))  # queued behind it (starts when it ends): not a cancellation
    tl.job_sent(job(1, 12, 5.0))  # not sampled
    start, end, outcome = tl.bars(8.0)[0]
    names = [OUTCOMES[o] for o in outcome]
    assert names == ["applied", "rejected", "lost", "lost", "rejected", "cancelled", "in flight"]
    assert end.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 8.0]
    assert tl.histogram.tolist() == [1]
    tl2 = Timeline([0])
    tl2.job_sent(job(0, 0, 0.0))  # wall clock: no finishing time until the reply
    assert [OUTCOMES[o] for o in tl2.bars(3.0)[0][2]] == ["in flight"]
    tl2.completed(Completion(job(0, 9, 0.0), 2.0, delay=0))  # a job sent before the timeline existed
    tl2.job_cancelled(job(0, 0, 0.0))
    start, end, outcome = tl2.bars(3.0)[0]
    assert [OUTCOMES[o] for o in outcome] == ["applied", "cancelled"] and end.tolist() == [2.0, 2.0]


def test_availability_shading_and_offline_time(tmp_path):
    n, period, d = 6, 24.0, 0.3
    model = Daily(n, period=period, fraction=d, seed=1)
    tl = Timeline(range(n))
    jid = 0
    for w in range(n):
        t = model.next_on(w, 0.0)
        while t < 240.0:
            end = min(model.next_off(w, t), t + 2.0)
            j = job(w, jid, t, end)
            tl.job_sent(j)
            tl.completed(Completion(j, end, delay=jid % 3))
            jid += 1
            t = model.next_on(w, end)
    png = plot_timeline(tmp_path / "tl.png", tl, t_end=240.0, availability=model, title="daily")
    assert png.stat().st_size > 1000
    assert plot_staleness(tmp_path / "st.png", tl).stat().st_size > 1000
    books = Books.sized(n)
    table = client_table(books, 240.0, availability=model, busy=np.full(n, 36.0))
    assert table["offline_time"] == pytest.approx([(1 - d) * 240.0] * n, rel=1e-12)
    assert table["idle_share"] == pytest.approx([1 - 36.0 / (d * 240.0)] * n, rel=1e-12)
    rows = read_csv(write_client_csv(tmp_path / "c.csv", table))
    assert len(rows) == n and float(rows[0]["offline_time"]) == pytest.approx((1 - d) * 240.0)
    # Not a whole number of periods: the vectorised answer is the sum of the offline intervals.
    walked = [sum(b - a for a, b in offline_intervals(model, c, 100.0)) for c in range(n)]
    assert offline_time(model, 100.0) == pytest.approx(walked, rel=1e-12)
    assert "busy_time" not in client_table(books, 240.0)


def test_offline_time_of_a_trace_and_of_always():
    trace = TraceAvailability.from_lists([[(-5.0, 2.0), (4.0, 6.0), (9.0, 30.0)], [], [(0.0, 10.0)]])
    assert offline_time(trace, 10.0).tolist() == pytest.approx([10.0 - 2.0 - 2.0 - 1.0, 10.0, 0.0])
    assert [sum(b - a for a, b in offline_intervals(trace, c, 10.0)) for c in range(3)] == pytest.approx(
        offline_time(trace, 10.0).tolist())
    assert offline_time(Always(4), 50.0).tolist() == [0.0] * 4
    assert offline_intervals(Always(1), 0, 50.0) == []
