"""A reply counts only as what it is: of the model's kind, from the node its job went to, and at once.

Hostile ClientApps, each a test app of its own: replies of the wrong dtype (``layout._cast``), a node
that forges replies to another node's jobs (``InProcessGrid._execute``, ``Transport.accept_one``), a
mod that replies to the reply (``LocalDpMod`` on the whole ClientApp: ``fl_rescaled.matching``), and
nodes that do not answer (``grid_api.WAIT_NOTICE_EVERY``: the log says so; the TTL books them lost).
No timing is asserted: ``no_hang`` only fails a test that would otherwise wait for a TTL of an hour.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import LocalDpMod
from flwr.common.constant import SUPERLINK_NODE_ID

from fl_rescaled import DelayModel, FedAsync, InProcessGrid, RescaledASGD, RunFailed, VirtualClock, WallClock
from fl_rescaled import grid_api
from fl_rescaled.grid_api import set_message_id
from fl_rescaled.manager import Job, OnEvent
from fl_rescaled.manager.manager import SET_ASIDE_AFTER
from fl_rescaled.manager.transport import Transport
from conftest import run_of, start_run

B = np.array([[1.0, -1.0, 0.5], [0.8, -1.2, 0.4], [1.1, -0.9, 0.6]])  # node i pulls towards B[i]
X0 = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
ONES = ArrayRecord({"w": Array(np.ones(3, np.float32))})  # (LocalDpMod divides by the update's norm)


@contextmanager
def no_hang(seconds: int = 120):
    """Fail (rather than wait for a TTL of an hour) if the block has not ended after ``seconds``."""
    def expired(signum, frame):
        raise AssertionError(f"still waiting after {seconds} s: a job or an evaluation was waited for in silence")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def gradient(msg: Message, context) -> np.ndarray:
    """Node i's gradient of ½‖x − B[i]‖² at the model it was sent (float64)."""
    x = msg.content["arrays"]["w"].numpy().astype(np.float64)
    return x - B[int(context.node_config["partition-id"])]


def reply(msg: Message, arrays: dict, to: Message | None = None) -> Message:
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord({"num-examples": 1})}),
                   reply_to=to or msg)


# ---------------------------------------------------------------------------------- dtypes
dtype_app = ClientApp()


@dtype_app.train()
def dtype_train(msg, context):
    """Partition 1 answers in the dtype its node config names; the others in float32."""
    g = gradient(msg, context)
    kind = context.node_config.get("reply-dtype", "float32")
    if kind == "huge":  # a float64 beyond float32's range
        return reply(msg, {"w": Array(np.full(3, 1e300))})
    return reply(msg, {"w": Array(g.astype(kind) if kind != "bool" else g > 0)})


def dtype_run(kind: str):
    """RescaledASGD on three nodes (worker i = partition i), partition 1 answering in ``kind``:
    (final model, books, events (worker, rejected, detail, model before, model after))."""
    configs = [{}, {"reply-dtype": kind}, {}]
    grid = InProcessGrid(dtype_app, 3, node_configs=configs, ordered_ids=True)
    s = RescaledASGD(lr=0.1, fraction_evaluate=0)
    events, prev = [], {"x": np.zeros(3, np.float32)}

    def on_event(comp, x):
        events.append((comp.worker, comp.rejected, comp.detail, prev["x"], x.copy()))
        prev["x"] = x.copy()

    res = start_run(s, grid, X0, num_updates=30, clock=VirtualClock(DelayModel([1.0, 1.3, 1.7])),
                  observers=[OnEvent(on_event)])
    return res.arrays["w"].numpy(), run_of(s).manager.books, events


@pytest.mark.parametrize("kind", ["int8", "bool"])
def test_an_integer_or_bool_reply_to_a_float_model_is_refused(kind):
    _, books, events = dtype_run(kind)
    rejected = [e for e in events if e[1] is not None]
    assert rejected and {(w, r) for w, r, *_ in rejected} == {(1, "wrong-dtype")}
    assert len(rejected) == SET_ASIDE_AFTER  # (then the worker is set aside)
    assert f"array 'w' is {kind}, expected float32" in rejected[0][2]
    for _, _, _, before, after in rejected:  # the model is bit for bit what it was
        assert before.tobytes() == after.tobytes()
    assert books.by_reason("rejected") == {"wrong-dtype": SET_ASIDE_AFTER}
    assert all(r["balanced"] for r in books.balance())


def test_a_float64_reply_to_a_float32_model_is_cast_down_and_used():
    x64, books, events = dtype_run("float64")
    x32, _, events32 = dtype_run("float32")
    assert books.failures() == {} and books.count("applied")[1] > 0
    assert x64.dtype == np.float32 and x64.tobytes() == x32.tobytes()  # (cast as the client would have)
    assert [e[0] for e in events] == [e[0] for e in events32]


def test_a_float64_beyond_float32s_range_becomes_inf_and_is_refused():
    _, books, events = dtype_run("huge")
    assert books.by_reason("rejected") == {"non-finite": SET_ASIDE_AFTER}
    assert all(before.tobytes() == after.tobytes() for _, r, _, before, after in events if r is not None)


# ---------------------------------------------------------------------------------- forged replies
class Forgery:
    """Shared by the ClientApps of one process, as a global would be: the messages node 0 (the
    victim) was sent, newest last, and how many replies node 2 (the forger) built on them."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.victim: list[Message] = []
        self.forged = 0


FORGERY = Forgery()
forge_app = ClientApp()


@forge_app.train()
def forge_train(msg, context):
    """Node 0 takes 0.05 s per job, node 1 0.02 s (so 30 updates take longer than node 0's first
    job); node 2 answers every job with a NaN reply to node 0's newest message (waiting up to 5 s
    for one it has not forged yet)."""
    partition = int(context.node_config["partition-id"])
    if partition == 0:
        with FORGERY.cond:
            FORGERY.victim.append(msg)
            FORGERY.cond.notify_all()
        time.sleep(0.05)
    if partition == 1:
        time.sleep(0.02)
    if partition == 2:
        with FORGERY.cond:
            FORGERY.cond.wait_for(lambda: len(FORGERY.victim) > FORGERY.forged, timeout=5.0)
            FORGERY.forged = len(FORGERY.victim)
            target = FORGERY.victim[-1]
        return reply(msg, {"w": Array(np.full(3, np.nan, np.float32))}, to=target)
    return reply(msg, {"w": Array(gradient(msg, context).astype(np.float32))})


def test_a_node_that_forges_another_nodes_replies_fails_its_own_jobs_not_the_victims():
    """Wall clock (one thread per node): node 2 answers with a reply to node 0's job in flight, which
    would arrive before node 0's own. Before: node 0's jobs were charged (non-finite) and it was set
    aside. Now: node 2's own jobs fail at once, with the reason; node 0 is untouched."""
    FORGERY.__init__()
    grid = InProcessGrid(forge_app, 3, threaded=True, ordered_ids=True)
    s = RescaledASGD(lr=0.1, fraction_evaluate=0)
    try:
        with no_hang():
            start_run(s, grid, X0, num_updates=30, clock=WallClock(0.01), timeout=60.0)
    finally:
        with FORGERY.cond:
            FORGERY.forged = -1  # (release a forger still waiting)
            FORGERY.cond.notify_all()
        grid.close()
    manager = run_of(s).manager
    books = manager.books
    assert FORGERY.forged != 0
    assert books.count("rejected")[0] == 0 and books.strikes[0] == 0 and manager.is_online(0)
    assert books.count("applied")[0] > 0
    assert set(books.by_reason("lost")) == {"error-code-0"} and books.count("lost")[2] == books.count("lost").sum()
    assert books.first_failure[0] == "error-code-0"
    assert "ClientApp answered message" in books.first_failure[1] and "with a reply to message" in books.first_failure[1]
    assert all(r["balanced"] for r in books.balance())


def test_the_in_process_grid_turns_a_forged_reply_into_an_error_to_the_forgers_message():
    seen: list[Message] = []
    app = ClientApp()

    @app.train()
    def train(msg, context):
        seen.append(msg)
        return reply(msg, {"w": Array(np.zeros(3, np.float32))}, to=seen[0])  # always to the first message

    grid = InProcessGrid(app, 2)
    victim, forger = grid.node_ids
    ids = list(grid.push_messages([Message(RecordDict({"arrays": X0}), n, "train") for n in (victim, forger)]))
    honest, forged = list(grid.pull_messages(ids))
    assert not honest.has_error() and honest.metadata.reply_to_message_id == ids[0]
    assert forged.has_error() and forged.metadata.reply_to_message_id == ids[1]
    assert forged.metadata.src_node_id == forger and forged.error.code == 0
    assert f"answered message {ids[1]!r} with a reply to message {ids[0]!r} (node {victim}'s)" in forged.error.reason


def _transport_with_job(node: int = 11):
    """A Transport on an in-process Grid with one job in flight for ``node``; (transport, job, message)."""
    grid = InProcessGrid(ClientApp(), 1)
    transport = Transport(grid, ttl=60.0)
    job = Job(0, 0, 0, 0, 0.0, node_id=grid.node_ids[0], model=X0)
    transport.push_job(job)
    sent = Message(RecordDict(), job.node_id, "train")
    set_message_id(sent, job.message_id)
    return transport, job, sent


def test_the_transport_takes_a_reply_only_from_the_node_its_job_went_to():
    """Whatever the Grid (a custom one, a runtime that let it through): a reply naming a job of
    node V but coming from node A is a stray (``wrong-node``), and V's job stays in flight for its
    own reply; an error the SuperLink sent itself (src 1) is read as the job's."""
    transport, job, sent = _transport_with_job()
    strays = []
    transport.on_stray = strays.append
    forged = reply(sent, {"w": Array(np.full(3, np.nan, np.float32))})
    forged.metadata.__dict__["_src_node_id"] = job.node_id + 1
    assert transport.accept_one(forged) is False
    assert strays == ["wrong-node"] and job.message_id in transport.inflight and not transport.arrived
    own = reply(sent, {"w": Array(np.zeros(3, np.float32))})
    assert transport.accept_one(own) is True and transport.arrived[job.message_id] is own

    transport, job, sent = _transport_with_job()
    expired = Message(Error(code=3, reason="expired"), reply_to=sent)
    expired.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
    assert transport.accept_one(expired) is True and transport.arrived[job.message_id] is expired
    transport, job, sent = _transport_with_job()
    content = reply(sent, {"w": Array(np.zeros(3, np.float32))})
    content.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID  # (the SuperLink sends errors, never content)
    assert transport.accept_one(content) is False and not transport.arrived


class SlipGrid(InProcessGrid):
    """Slips, before each reply of node 0, a NaN copy of it that claims node 1 sent it."""

    def __init__(self, slip: bool) -> None:
        super().__init__(dtype_app, 3, ordered_ids=True)
        self.slip, self.slipped = slip, 0

    def pull_messages(self, message_ids):
        out = []
        for rep in super().pull_messages(message_ids):
            if self.slip and rep.metadata.src_node_id == self.node_ids[0] and not rep.has_error():
                sent = Message(RecordDict(), self.node_ids[0], "train")
                set_message_id(sent, rep.metadata.reply_to_message_id)
                forged = reply(sent, {"w": Array(np.full(3, np.nan, np.float32))})
                forged.metadata.__dict__["_src_node_id"] = self.node_ids[1]
                out.append(forged)
                self.slipped += 1
            out.append(rep)
        return out


def test_on_the_virtual_clock_a_slipped_in_reply_from_another_node_changes_nothing():
    results = []
    for slip in (False, True):
        grid = SlipGrid(slip)
        s = RescaledASGD(lr=0.1, fraction_evaluate=0)
        res = start_run(s, grid, X0, num_updates=30, clock=VirtualClock(DelayModel([1.0, 1.3, 1.7])))
        results.append((res.arrays["w"].numpy(), run_of(s).manager.books, grid.slipped))
    (clean, _, _), (x, books, slipped) = results
    assert slipped > 0 and books.stray == {"wrong-node": slipped} and books.failures() == {}
    assert x.tobytes() == clean.tobytes()
    assert all(r["balanced"] for r in books.balance())


# ---------------------------------------------------------------------------------- replies to no message
def two_records(msg, context):
    x = msg.content["arrays"]["w"].numpy()
    return Message(RecordDict({"arrays": ArrayRecord({"w": Array(x * 0.9)}), "extra": ArrayRecord({"v": Array(x)}),
                               "metrics": MetricRecord({"num-examples": 10})}), reply_to=msg)


def one_record(msg, context):
    x = msg.content["arrays"]["w"].numpy()
    return Message(RecordDict({"arrays": ArrayRecord({"w": Array(x * 0.9)}),
                               "metrics": MetricRecord({"num-examples": 10})}), reply_to=msg)


def evaluate(msg, context):
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 10, "loss": 1.5})}), reply_to=msg)


def dp():
    return LocalDpMod(1.0, 1.0, 1.0, 1e-5)


def test_localdpmod_on_the_whole_clientapp_fails_each_job_at_once_with_the_advice():
    """LocalDpMod refuses a reply with two ArrayRecords by replying to the reply (reply_to_message_id
    empty). Before: each job waited for its TTL (an hour), then was lost as "no reply"."""
    app = ClientApp(mods=[dp()])
    app.train()(two_records)
    with no_hang(), pytest.raises(RunFailed) as failed:
        FedAsync(fraction_evaluate=0).start(InProcessGrid(app, 4), ONES, num_updates=10)
    text = str(failed.value)
    assert "(error-code-6)" in text and "empty reply_to_message_id" in text
    assert "Return exactly one ArrayRecord from @app.train" in text
    books = failed.value.books
    assert books["lost.error-code-6"] == 4 and books["updates"] == 0 and books["balanced"] == 1


def test_localdpmod_on_the_whole_clientapp_fails_each_evaluation_at_once_and_on_train_works(caplog):
    """ClientApp(mods=[...]) wraps @app.evaluate too, whose reply holds no ArrayRecord: each
    federated evaluation failed only at its timeout (an hour); now at once, with the advice. The
    advised app (the mod on @app.train) then trains and evaluates."""
    whole = ClientApp(mods=[dp()])
    whole.train()(one_record)
    whole.evaluate()(evaluate)
    with no_hang(), caplog.at_level(logging.WARNING, logger="flwr.fl_rescaled"):
        res = FedAsync().start(InProcessGrid(whole, 3), ONES, num_updates=6, num_evaluations=2)
    assert res.books["updates"] == 6 and res.evaluate_metrics_clientapp == {}
    warned = [r.getMessage() for r in caplog.records if "federated evaluation" in r.getMessage()]
    assert warned and "@app.evaluate too: attach the mod to @app.train(mods=[...]) instead" in warned[0]

    advised = ClientApp()
    advised.train(mods=[dp()])(one_record)
    advised.evaluate()(evaluate)
    with no_hang():
        res = FedAsync().start(InProcessGrid(advised, 3), ONES, num_updates=6, num_evaluations=2)
    assert res.books["updates"] == 6 and res.books["lost"] == res.books["rejected"] == 0
    assert res.evaluate_metrics_clientapp and all(m["loss"] == 1.5 for m in res.evaluate_metrics_clientapp.values())


# ---------------------------------------------------------------------------------- nobody answers
class ReleaseOn(logging.Handler):
    """Sets ``event`` when a log line contains ``text`` (the ClientApps below wait for it)."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text, self.event, self.lines = text, threading.Event(), []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if self.text in line:
            self.lines.append(line)
            self.event.set()


@contextmanager
def released_on(text: str, monkeypatch):
    monkeypatch.setattr(grid_api, "WAIT_NOTICE_EVERY", 0.05, raising=False)
    handler = ReleaseOn(text)
    logger = logging.getLogger("flwr.fl_rescaled")
    saved = logger.level  # (a command line run in this process may have left it at ERROR)
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)
        handler.event.set()


def test_on_the_wall_clock_the_log_says_what_is_in_flight_and_the_ttl_books_it_lost(monkeypatch):
    """Every node waits until the log says that jobs are in flight and none finished (up to 30 s);
    then nodes 1 and 2 answer, each after 0.05 s, and node 0 never does: 40 updates take at least
    1 s, past its job's TTL (0.5 s), which books it lost."""
    with released_on("job(s) in flight and none finished", monkeypatch) as said:
        never = threading.Event()
        app = ClientApp()

        @app.train()
        def train(msg, context):
            said.event.wait(30)
            if int(context.node_config["partition-id"]) == 0:
                never.wait(30)
            time.sleep(0.05)
            return reply(msg, {"w": Array(gradient(msg, context).astype(np.float32))})

        grid = InProcessGrid(app, 3, threaded=True, ordered_ids=True)
        s = RescaledASGD(lr=0.1, fraction_evaluate=0)
        try:
            with no_hang():
                start_run(s, grid, X0, num_updates=40, clock=WallClock(0.01), timeout=0.5)
        finally:
            never.set()
            grid.close()
    assert said.lines, "the log never said that jobs were waited for"
    assert "3 job(s) in flight and none finished for" in said.lines[0]
    assert "the oldest, job 0 on node" in said.lines[0] and "its TTL (0.5 s) books it lost in" in said.lines[0]
    books = run_of(s).manager.books
    assert books.by_reason("lost").get("ttl-expired", 0) >= 1 and books.count("lost")[0] >= 1
    assert all(r["balanced"] for r in books.balance())


def test_on_the_virtual_clock_a_reply_that_does_not_come_is_announced(monkeypatch):
    """The Grid computes jobs ahead on a pool; every ClientApp waits until the log says that the
    reply to a job is awaited (up to 30 s)."""
    with released_on("still waiting for the reply to job", monkeypatch) as said:
        app = ClientApp()

        @app.train()
        def train(msg, context):
            said.event.wait(30)
            return reply(msg, {"w": Array(gradient(msg, context).astype(np.float32))})

        grid = InProcessGrid(app, 2, workers=2)
        s = RescaledASGD(lr=0.1, fraction_evaluate=0)
        try:
            with no_hang():
                res = start_run(s, grid, X0, num_updates=4, clock=VirtualClock(DelayModel([1.0, 1.5])))
        finally:
            grid.close()
    assert said.lines and "1 of 1 missing, none came for" in said.lines[0]
    assert "its TTL (3600 s) books it lost in" in said.lines[0]
    assert res.books["updates"] == 4 and res.books["lost"] == 0
