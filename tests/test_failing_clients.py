"""No round waits for ever: a client that fails every job is set aside, and the rounds close on the
clients that remain.

Four nodes as in ``tests/hostile.py`` (τ = 1, 1.3, 1.7, 2.2); the failing ones raise in their
ClientApp (Flower's error reply, code 2) on every job. Before, an error reply was no strike: a round
of Malenia or Ringleader waited for the failing client for the whole budget (no update), and
Minibatch and FedAvg stopped after 20 failures in a row. On the wall clock the nodes run on
threads and sleep their τ × 10 ms per job.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

import hostile
from conftest import assert_books_balance, quad, run_of, start_run
from fl_rescaled import DelayModel, InProcessGrid, RunFailed, VirtualClock, WallClock, add_partition_query
from fl_rescaled.manager import OnEvent
from fl_rescaled.manager.books import Books
from fl_rescaled.manager.manager import SET_ASIDE_AFTER
from fl_rescaled.strategies import STRATEGIES

ROUND_BASED = ["malenia", "ringleader", "minibatch", "fedavg"]
BUDGET = 400.0
UNIT = 0.01  # wall clock: seconds per time unit


def train(msg: Message, context: Context) -> Message:
    cfg = context.node_config
    if cfg.get("sleep"):
        import time

        time.sleep(float(cfg["sleep"]))
    if cfg.get("fail"):
        raise RuntimeError(f"partition {cfg['partition-id']} cannot train")
    return hostile.train(msg, context)


app = ClientApp()
app.train()(train)
add_partition_query(app)


def grid(failing=(), wall=False) -> InProcessGrid:
    configs = [{"fail": i in failing, "sleep": hostile.TAUS[i] * UNIT if wall else 0.0} for i in range(hostile.N)]
    return InProcessGrid(app, hostile.N, node_configs=configs, threaded=wall)


def strategy(name):
    return STRATEGIES[name](reply=STRATEGIES[name].default_reply, fraction_evaluate=0.0)


def start(name, g, wall=False, observers=(), s=None, **budget):
    s = s or strategy(name)
    clock = WallClock(UNIT) if wall else VirtualClock(DelayModel(hostile.TAUS))
    budget = budget or {"time_budget": BUDGET}
    try:
        return s, start_run(s, g, ArrayRecord({"w": Array(np.zeros(hostile.DIM, np.float32))}), clock=clock,
                          train_config={"reply": s.reply}, partition_query=True, observers=list(observers), **budget)
    finally:
        g.close()


def set_aside_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]


@pytest.mark.parametrize("name", ROUND_BASED)
def test_a_client_that_always_raises_is_set_aside_and_the_rounds_go_on(name, caplog):
    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    _, honest = start(name, grid())
    s, res = start(name, grid(failing=[2]))
    books = dict(res.books)
    assert books["updates"] >= honest.books["updates"] / 2 > 0, (books["updates"], honest.books["updates"])
    assert books["lost.error-code-2"] == SET_ASIDE_AFTER and books["lost-per-worker"][2] == SET_ASIDE_AFTER
    assert books["sent-per-worker"][2] == SET_ASIDE_AFTER  # no job after it was set aside
    assert_books_balance(books, name)
    assert not run_of(s).manager.is_online(2)
    (line,) = set_aside_lines(caplog)
    assert line.startswith("partition 2 set aside") and "RuntimeError: partition 2 cannot train" in line, line


@pytest.mark.parametrize("name", ROUND_BASED)
def test_the_round_closes_when_the_client_it_waits_for_is_set_aside(name):
    """Partition 3 is the slowest: the others have delivered when its third failure sets it aside.
    Malenia, Minibatch and FedAvg step at that very event (Minibatch's and FedAvg's other workers
    are idle: nothing else could close the round); Ringleader's gathering ends at the next arrival."""
    events = []
    s = strategy(name)

    def seen(comp, x):
        events.append((comp.worker, comp.rejected, run_of(s).version))

    _, res = start(name, grid(failing=[3]), observers=[OnEvent(seen)], s=s, time_budget=40.0)
    fails = [i for i, e in enumerate(events) if e[1] is not None]
    assert len(fails) == SET_ASIDE_AFTER and all(events[i][0] == 3 for i in fails)
    out = fails[-1]
    assert all(v == 0 for _, _, v in events[:out]), "no round closed while partition 3 was waited for"
    if name == "ringleader":
        assert events[out + 1][2] == 1
    else:
        assert events[out][2] == 1
    assert res.books["updates"] > 5


@pytest.mark.parametrize("name", ROUND_BASED)
def test_on_the_wall_clock_the_round_closes_without_the_failing_client(name, caplog):
    """Threaded nodes; the slowest fails. The run reaches its 30 updates long before its time
    budget (10 s) would stop it; the client is set aside, not sent a job again, and named."""
    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    s, res = start(name, grid(failing=[3], wall=True), wall=True, num_updates=30, time_budget=1000.0)
    books = dict(res.books)
    assert books["updates"] == 30
    assert books["lost.error-code-2"] == SET_ASIDE_AFTER and books["sent-per-worker"][3] == SET_ASIDE_AFTER
    assert_books_balance(books, name)
    (line,) = set_aside_lines(caplog)
    assert line.startswith("partition 3 set aside") and "RuntimeError" in line and "60 s" in line, line


@pytest.mark.parametrize("name", ["malenia", "minibatch", "rescaled"])
def test_more_than_half_failing_stops_the_run_at_once_naming_them(name):
    """Three of four clients fail: two are set aside (half the workers stay), the third may not be,
    and the run stops there with RunFailed naming the three, instead of running out its budget."""
    with pytest.raises(RunFailed) as info:
        start(name, grid(failing=[1, 2, 3]))
    msg = str(info.value)
    assert "3 of 4 clients failed" in msg and all(f"partition {i}" in msg for i in (1, 2, 3)), msg
    assert "RuntimeError: partition" in msg and "\n" not in msg
    books = info.value.books
    assert books["time"] < BUDGET / 20 and books["lost"] == 3 * SET_ASIDE_AFTER, books


def test_two_of_four_failing_are_both_set_aside(caplog):
    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    _, res = start("malenia", grid(failing=[0, 3]))
    assert res.books["updates"] > 50 and res.books["lost"] == 2 * SET_ASIDE_AFTER
    assert sorted(line.split(" set aside")[0] for line in set_aside_lines(caplog)) == ["partition 0", "partition 3"]


def test_which_failures_are_strikes():
    """Rejections, the ClientApp's error replies (any code but 3, 4, 5) and a TTL that ran out count;
    a node that left, went offline or whose message expired in transit, and a restart, do not."""
    strikes = {}
    for reason in ("rejected.malformed", "lost.error-code-0", "lost.error-code-1", "lost.error-code-2",
                   "lost.error-code-6", "lost.error-code-8", "lost.error-code-other", "lost.ttl-expired", "lost.lost",
                   "lost.error-code-3", "lost.error-code-4", "lost.error-code-5", "lost.offline", "lost.resumed"):
        books = Books.sized(1)
        books.sent(0)
        books.ended(0, reason)
        strikes[reason] = int(books.strikes[0])
    assert [r for r, k in strikes.items() if not k] == ["lost.error-code-3", "lost.error-code-4", "lost.error-code-5",
                                                       "lost.offline", "lost.resumed"]
    books.sent(0)
    books.ended(0, "applied")
    assert books.strikes[0] == 0


@pytest.mark.parametrize("name", ["rescaled", "malenia"])
def test_a_client_set_aside_stays_aside_when_its_availability_brings_it_back(name):
    """Virtual clock with daily availability: client 0's replies overflow (rejected). Set aside after
    three, it is not sent a job when it comes online again (before, Rescaled sent it 150)."""
    out = quad(strategy=name, taus=[1, 2, 3, 2], quad_a=[1e308, 1, 1, 1], quad_b=[1, 0, 2, 1], quad_x0=0.0, lr=0.05,
               budget=300, eval_every=100, availability="daily", availability_period=10.0, availability_fraction=0.5)
    books = out["books"]
    assert books["sent-per-worker"][0] == books["rejected-per-worker"][0] == SET_ASIDE_AFTER, books
    assert min(books["applied-per-worker"][1:]) > 10


def test_on_the_wall_clock_a_client_set_aside_is_tried_again_after_its_time_then_for_twice_as_long(
        caplog, monkeypatch):
    """With 0.2 s for the first time (60 s in a run) and nodes looked at every 0.05 s: the failing
    client gets one job again after its time, fails, and is set aside for 0.4 s. (The 60 rounds last
    at least 60 × 17 ms of the nodes' sleeps, on any machine: longer than 0.2 s, a look at the nodes
    and one 22 ms job.)"""
    import fl_rescaled.manager.reputation as manager
    from fl_rescaled.manager import ManagerSettings

    monkeypatch.setattr(manager, "SET_ASIDE_SECONDS", 0.2)
    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    _, res = start("malenia", grid(failing=[3], wall=True), wall=True, num_updates=60, time_budget=1000.0,
                   settings=ManagerSettings(node_refresh=0.05))
    lines = set_aside_lines(caplog)
    assert "its last 3 jobs failed" in lines[0] and "for 0.2 s" in lines[0], lines
    assert "its last 4 jobs failed" in lines[1] and "for 0.4 s" in lines[1], lines
    assert res.books["sent-per-worker"][3] >= SET_ASIDE_AFTER + 1 and res.books["updates"] == 60


def test_nodes_that_are_no_workers_do_not_pile_up_in_the_roster(caplog):
    """Wall clock, workers numbered by node id: every look at the nodes lists one more node that is
    no worker (a SuperNode that registers, leaves, and registers again under a new id). The roster
    keeps only the ones listed now (before, every one ever seen: one per look)."""
    from fl_rescaled.manager import ManagerSettings

    class Churn(InProcessGrid):
        looks = 0

        def get_node_ids(self):
            Churn.looks += 1
            return [*super().get_node_ids(), 2**62 + Churn.looks]  # (above every real id)

    g = Churn(app, hostile.N, node_configs=[{"sleep": t * UNIT} for t in hostile.TAUS], threaded=True)
    s = strategy("rescaled")
    try:
        start_run(s, g, ArrayRecord({"w": Array(np.zeros(hostile.DIM, np.float32))}), clock=WallClock(UNIT),
                train_config={"reply": "gradient"}, num_workers=hostile.N, num_updates=100, time_budget=1000.0,
                settings=ManagerSettings(node_refresh=0.01))
    finally:
        g.close()
    assert Churn.looks > 20 and len(run_of(s).manager.membership.roster.ignored) <= 1
