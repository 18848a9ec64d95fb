"""benchmarks/replay_schedule.py: the replay of two processes sharing a run's jobs, on event orders
small enough to follow by hand, and the recorder on a quadratic run (no timing is checked)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from fl_rescaled.experiment import RunSpec, run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def replay_module(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("replay_schedule", ROOT / "benchmarks" / "replay_schedule.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Jobs A (1) and B (2) sent; B's reply is wanted first, then A's.
TWO = [("sent", 1), ("sent", 2), ("wanted", 2), ("wanted", 1)]


def test_in_the_order_sent_the_loop_computes_the_wanted_job_the_worker_has_not_started(replay_module):
    # The worker starts A at 0 (ends at 100); B is wanted at 0, not started: the loop computes it (50)
    # and works (10); A is wanted at 60 and runs till 100: the loop waits 40 and works (10).
    got = replay_module.replay(TWO, loop=10, steal=50, job=100, order="sent")
    assert got == {"T": 55.0, "steals": 0.5, "waited": 20.0}


def test_in_the_order_wanted_the_worker_takes_the_first_wanted_job(replay_module):
    # The worker starts B (wanted first) at 0: the loop waits for it till 100, works till 110; A runs
    # from 100 to 200: the loop waits 90 and works till 210.
    got = replay_module.replay(TWO, loop=10, steal=50, job=100, order="wanted")
    assert got == {"T": 105.0, "steals": 0.0, "waited": 95.0}


def test_free_jobs_leave_the_loop_alone_and_late_ones_are_kept_for_it(replay_module):
    events = [("sent", j) for j in range(4)]
    for j in range(4, 40):  # one reply wanted, one job sent: four in flight
        events += [("wanted", j - 4), ("sent", j)]
    for order in ("sent", "wanted"):
        assert replay_module.replay(events, loop=10, steal=50, job=0, order=order) == {
            "T": 10.0, "steals": 0.0, "waited": 0.0}
    # A slack below minus any job's cost: every job is kept for the loop, and it computes each one.
    kept = replay_module.replay(events, loop=10, steal=50, job=100, order="wanted", slack=-1e9)
    assert kept == {"T": 60.0, "steals": 1.0, "waited": 0.0}


def test_the_recorder_sees_every_wanted_reply_after_its_job_was_sent(replay_module):
    seen = replay_module.EventOrder()
    out = run(RunSpec(task="quadratic", strategy="rescaled", budget=20, eval_every=1e9), observers=[seen])
    wanted = [j for kind, j in seen.events if kind == "wanted"]
    assert len(wanted) == out["num_updates"] > 0
    sent_at = {j: i for i, (kind, j) in enumerate(seen.events) if kind == "sent"}
    assert all(sent_at[j] < i for i, (kind, j) in enumerate(seen.events) if kind == "wanted")
