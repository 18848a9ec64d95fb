"""Nothing wrong gets in: every kind of bad reply is rejected, logged, counted, and the model untouched."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from fl_rescaled import DelayModel, InProcessGrid, MaleniaSGD, RescaledASGD, VirtualClock, WallClock
from fl_rescaled.clients.client_app import app
from fl_rescaled.layout import encode_array
from fl_rescaled.manager import OnEvent
from fl_rescaled.tasks import task_spec
from conftest import run_of, start_run

CFG = {"task": "quadratic", "num-partitions": 3, "quad-a": [1.0, 2.0, 1.0], "quad-b": [1.0, -2.0, 3.0],
       "quad-dim": 4}
BAD_JOB = 7  # the job whose reply gets corrupted


def _with_update(msg: Message, update, metrics=None, drop_update=False, key="model") -> Message:
    good = {"loss": 0.0, "num-examples": 1, "compute-time": 0.0}
    content = RecordDict({"metrics": MetricRecord(metrics or good)})
    if not drop_update:
        content["arrays"] = ArrayRecord({key: update})
    return Message(content, reply_to=msg)


class FaultyGrid(InProcessGrid):
    def __init__(self, fault: str | None) -> None:
        super().__init__(app, 3)
        self.fault = fault
        self._requests: dict[str, Message] = {}

    def _execute(self, msg):
        reply = super()._execute(msg)
        if msg.metadata.message_type != "train" or int(msg.content["config"]["job-id"]) != BAD_JOB:
            return reply
        f = self.fault
        if f == "nan":
            bad = _with_update(msg, encode_array(np.full(4, np.nan)))
        elif f == "inf":
            bad = _with_update(msg, encode_array(np.array([1.0, np.inf, 0.0, 0.0])))
        elif f == "wrong-shape":
            bad = _with_update(msg, encode_array(np.ones(5)))
        elif f == "wrong-dtype":  # (a float32 reply would be cast up to the float64 model: this one cannot)
            bad = _with_update(msg, encode_array(np.ones(4, dtype=np.complex64)))
        elif f == "missing":
            bad = _with_update(msg, None, drop_update=True)
        elif f == "wrong-key":
            bad = _with_update(msg, encode_array(np.ones(4)), key="weights")
        elif f == "not-npy":
            bad = _with_update(msg, Array(dtype="float64", shape=(4,), stype="numpy.ndarray", data=b"garbage"))
        elif f == "expired":  # what Flower's SuperLink sends for a job past its TTL: a "system" error
            bad = Message(Error(code=3, reason="message expired"), reply_to=msg)
            bad.metadata.__dict__["_message_type"] = "system"
        elif f == "error":
            bad = Message(Error(code=2, reason="<class 'RuntimeError'>:<'boom'>"), reply_to=msg)
        else:
            return reply
        bad.metadata.__dict__["_message_id"] = reply.metadata.message_id
        return bad

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        out = []
        for rep in replies:
            out.append(rep)
            job = self._job_of(rep)
            if self.fault == "duplicate" and job == BAD_JOB:
                out.append(rep)
            if self.fault == "stray" and job == BAD_JOB:
                stray = Message(RecordDict({"metrics": MetricRecord({"loss": 1.0})}), reply_to=self._stray_req())
                out.append(stray)
        return out

    def _job_of(self, rep):
        req = self._requests.get(rep.metadata.reply_to_message_id)
        if req is None or req.metadata.message_type != "train":
            return -1
        return int(req.content["config"]["job-id"])

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        for mid, msg in zip(ids, messages):
            self._requests[mid] = msg
        return ids

    def _stray_req(self):
        req = Message(RecordDict({"config": ConfigRecord({"x": 1})}), self.node_ids[0], "train")
        req.metadata.__dict__["_message_id"] = "never-sent"
        return req


def run_with(fault):
    events = []
    prev = {"x": None}

    def on_event(comp, x):
        events.append((comp.job.job_id, comp.rejected, prev["x"].copy(), x.copy(), comp.worker, comp.time))
        prev["x"] = x.copy()

    s = RescaledASGD(lr=0.05)
    x0 = np.full(4, 0.5)
    prev["x"] = x0.copy()
    start_run(s, FaultyGrid(fault), ArrayRecord({"model": Array(x0)}), time_budget=12,
            train_config={"task": task_spec(CFG)}, clock=VirtualClock(DelayModel([1, 2, 3])), partition_query=True,
            observers=[OnEvent(on_event)])
    return s, events


CONTENT_FAULTS = ["nan", "inf", "wrong-shape", "wrong-dtype", "missing", "wrong-key", "not-npy", "error"]


@pytest.mark.parametrize("fault", CONTENT_FAULTS)
def test_bad_reply_leaves_model_bit_identical(fault, caplog):
    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    s, events = run_with(fault)
    bad = [e for e in events if e[0] == BAD_JOB]
    assert len(bad) == 1
    _, reason, before, after, worker, t_bad = bad[0]
    assert reason is not None
    assert before.tobytes() == after.tobytes()
    books = run_of(s).manager.books
    assert sum(books.failures().values()) == 1
    rows = books.balance()  # the rejected job is accounted for, once: as rejected, or as lost (an error reply)
    assert all(r["balanced"] for r in rows) and sum(r["rejected"] + r["lost"] for r in rows) == 1
    assert sum(r["lost"] for r in rows) == (fault == "error")
    said = "lost" if fault == "error" else "rejected"
    assert any(said in r.message and reason in r.message for r in caplog.records)
    # Every other event was applied (the model moved), and the bad job's worker kept working.
    others = [e for e in events if e[0] != BAD_JOB]
    assert all(e[1] is None and e[2].tobytes() != e[3].tobytes() for e in others)
    assert any(e[4] == worker and e[5] > t_bad for e in others)


@pytest.mark.parametrize("fault", ["duplicate", "stray"])
def test_duplicate_and_stray_replies_change_nothing(fault):
    clean, clean_events = run_with(None)
    s, events = run_with(fault)
    reason = "duplicate" if fault == "duplicate" else "unknown-job"
    books = run_of(s).manager.books
    assert books.stray == {reason: 1} and books.failures() == {}  # a stray is no job's outcome
    assert len(events) == len(clean_events)
    assert run_of(s).x.tobytes() == run_of(clean).x.tobytes()


def test_reasons_are_specific_and_name_what_was_expected():
    expected = {
        "nan": ("non-finite", "NaN or infinite values in 'model'"),
        "inf": ("non-finite", "NaN or infinite values in 'model'"),
        "wrong-shape": ("wrong-shape", "array 'model' has shape [5], expected [4]"),
        "wrong-dtype": ("wrong-dtype", "array 'model' is complex64, expected float64"),
        "missing": ("malformed", "the reply has no ArrayRecord (expected one named 'arrays')"),
        "wrong-key": ("malformed", "arrays missing 'model'; unexpected 'weights' (the model's arrays are {'model': float64[4]})"),
        "not-npy": ("malformed", "array 'model' cannot be decoded"),
        "error": ("error-code-2", "<class 'RuntimeError'>:<'boom'>"),
    }
    for fault, (reason, detail) in expected.items():
        s, events = run_with(fault)
        books = run_of(s).manager.books
        assert books.failures() == {reason: 1}, fault
        assert books.first_failure[0] == reason
        assert detail in books.first_failure[1], (fault, books.first_failure)


def test_an_expired_job_is_lost_not_a_wrong_type():
    """Flower answers a job past its TTL with an error of type "system": it is booked as lost
    (error-code-3), not rejected as a reply of the wrong type (a deployment test caught that)."""
    s, events = run_with("expired")
    books = run_of(s).manager.books
    assert books.by_reason("lost") == {"error-code-3": 1} and books.by_reason("rejected") == {}


def test_a_job_of_a_restarted_workers_old_node_is_not_replaced():
    """A worker whose SuperNode restarted got its jobs when it rejoined; its old node's expired job
    must not add one more (it ended with two jobs in flight for jobs_per_node=1)."""
    from types import SimpleNamespace

    from scripted import ScriptedRun

    s = RescaledASGD()
    run = ScriptedRun(n=1, x=np.zeros(2), nodes=[22])
    s.on_rejected(run, SimpleNamespace(worker=0, job=SimpleNamespace(node_id=11)))  # the old node's job
    assert run.sent == []
    s.on_rejected(run, SimpleNamespace(worker=0, job=SimpleNamespace(node_id=22)))  # the current node's
    assert run.sent == [0]


# ================================================================================ a reply's metrics
def _metrics_reply(entries: dict, config: dict | None = None) -> RecordDict:
    """A reply's content whose MetricRecord holds ``entries`` as they are (past MetricRecord's own
    type check, as an in-process reply can be), with a ConfigRecord ``config`` beside it."""
    rec = MetricRecord({})
    for k, v in entries.items():
        rec._data[k] = v  # noqa: SLF001
    content = RecordDict({"metrics": rec})
    if config is not None:
        content["cfg"] = ConfigRecord(config)
    return content


def test_reply_metrics_keeps_finite_numbers_and_drops_the_rest(caplog):
    from fl_rescaled.messages import reply_metrics

    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    nan, inf = float("nan"), float("inf")
    content = _metrics_reply({
        "loss": 0.5, "acc": nan, "top": -inf, "n": 2**63 - 1, "huge": 10**400, "flag": True, "text": "abc",
        "per-client": [0.1, 0.2], "ints": [1, 2], "bad-list": [1.0, nan], "mixed": [1.0, "a"], "empty": [],
        "num-examples": 12.0, "compute-time": 1e9, "$array": 1.0,
    }, config={"compute-time": "abc", "note": "x"})
    assert reply_metrics(content) == {"loss": 0.5, "n": 2**63 - 1, "per-client": [0.1, 0.2], "ints": [1, 2],
                                      "empty": [], "num-examples": 12, "compute-time": 1e9}
    assert type(reply_metrics(content)["num-examples"]) is int
    for bad in (-3, 2.5, inf, nan, True):
        assert "num-examples" not in reply_metrics(_metrics_reply({"num-examples": bad}))
    for bad in (-5.0, nan, inf, -1e-300):
        assert "compute-time" not in reply_metrics(_metrics_reply({"compute-time": bad}))
    assert reply_metrics(_metrics_reply({"compute-time": 0.0})) == {"compute-time": 0.0}
    caplog.clear()
    reply_metrics(_metrics_reply({"acc2": nan}))
    reply_metrics(_metrics_reply({"acc2": nan}))
    assert sum("acc2" in r.message for r in caplog.records) == 1  # logged once


@pytest.mark.parametrize("reported", [1e9, float("nan"), -5.0, "abc", None])
def test_a_cancelled_replys_compute_time_is_clamped_to_what_the_server_saw(reported):
    """The wall clock books a cancelled job's reply as wasted work: a reported time beyond what the
    server observed (1e9), not a number, negative, text (a ConfigRecord's) or missing counts as the
    time from dispatch to reply."""
    from fl_rescaled.grid import set_server_identity
    from fl_rescaled.manager import Job, WallSource

    set_server_identity(1)  # (to build a Message outside a Grid)

    entries = {} if reported is None or isinstance(reported, str) else {"compute-time": reported}
    config = {"compute-time": reported} if isinstance(reported, str) else None
    rep = Message(_metrics_reply(entries, config), reply_to=Message(RecordDict(), 1, "train"))
    src = WallSource(WallClock(0.5), transport=None, membership=None)  # (only its clock is used here)
    job = Job(0, 0, 0, 0, 0.0, pushed_at=time.monotonic() - 0.2)
    spent = src.cancelled_reply(job, rep)
    assert 0.2 / 0.5 <= spent <= (time.monotonic() - job.pushed_at) / 0.5


def test_malenia_on_the_wall_clock_survives_hostile_metrics_in_cancelled_replies():
    """Malenia's rounds cancel jobs whose replies still come (the wall clock): a reply with a
    ConfigRecord ``compute-time`` of "abc" and MetricRecord values of 1e9, NaN or −5 goes through the
    same validation as any other, and the run ends with its books balanced."""
    from flwr.clientapp import ClientApp

    values = [1e9, float("nan"), -5.0]

    def train(msg, context):
        i = int(context.node_config["partition-id"])
        time.sleep(0.002 * (1 + 2 * i))
        g = msg.content["arrays"]["model"].numpy() - i
        content = _metrics_reply({"compute-time": values[int(msg.content["config"]["job-seq"]) % 3],
                                  "num-examples": 1}, {"compute-time": "abc"})
        content["arrays"] = ArrayRecord({"model": Array(g)})
        return Message(content, reply_to=msg)

    client = ClientApp()
    client.train()(train)
    grid = InProcessGrid(client, 3, threaded=True)
    try:
        s = MaleniaSGD(lr=0.5)
        res = start_run(s, grid, ArrayRecord({"model": Array(np.zeros(2))}), time_budget=300, clock=WallClock(0.001))
    finally:
        grid.close()
    books = dict(res.books)
    assert books["balanced"] == 1 and books["updates"] > 0 and books["discarded"] > 0
    assert np.isfinite(run_of(s).manager.books.wasted).all() and (run_of(s).manager.books.wasted >= 0).all()


# ------------------------------------------------------------------ records built in one step
# ``messages.plain_record`` fills a record's dict directly when Flower's checks would pass every
# item, and leaves anything else to Flower's constructor. Built both ways, the records must be the
# same to Flower: equal contents, the same types, the same bytes on the wire; and what Flower
# refuses, plain_record refuses the same way.
_VALID = [
    (ConfigRecord, {"lr": 0.05, "steps": 3, "name": "x", "blob": b"\x00\x01", "on": True}),
    (ConfigRecord, {}),
    (MetricRecord, {"num-examples": 64, "loss": 0.25, "big": 2**62}),
    (MetricRecord, {"loss": float("nan")}),  # (Flower takes it; reply_metrics drops it later)
]
_INVALID = [
    (ConfigRecord, {"lr": [0.1, 0.2]}),  # a list: Flower's own path
    (ConfigRecord, {"lr": np.float64(0.1)}),  # a numpy scalar (a float subclass): Flower's own path
    (ConfigRecord, {1: 0.1}),  # a key that is not a string
    (ConfigRecord, {"x": None}),
    (MetricRecord, {"flag": True}),  # bool is no metric
    (MetricRecord, {"name": "abc"}),
    (MetricRecord, {"loss": [0.1, 0.2]}),
]


def _built(build, cls, values):
    try:
        return build(cls, values), None
    except Exception as exc:  # noqa: BLE001 (compared below)
        return None, type(exc)


@pytest.mark.parametrize("cls,values", _VALID + _INVALID)
def test_a_record_built_in_one_step_is_flowers_record(cls, values):
    from flwr.common import serde

    from fl_rescaled.messages import plain_record

    ours, our_error = _built(plain_record, cls, values)
    theirs, their_error = _built(lambda c, v: c(v), cls, values)
    assert our_error is their_error
    if theirs is None:
        return
    def same(record):  # (NaN equals NaN here)
        return {k: "nan" if isinstance(v, float) and v != v else v for k, v in record.items()}

    assert type(ours) is type(theirs) and same(ours) == same(theirs)
    assert [type(v) for v in ours.values()] == [type(v) for v in theirs.values()]
    to_proto = serde.config_record_to_proto if cls is ConfigRecord else serde.metric_record_to_proto
    assert to_proto(ours).SerializeToString(deterministic=True) == to_proto(theirs).SerializeToString(deterministic=True)


def test_a_recorddict_built_in_one_step_is_flowers_recorddict():
    from flwr.common import serde

    from fl_rescaled.messages import plain_record

    parts = {"arrays": ArrayRecord({"w": Array(np.arange(6, dtype=np.float32).reshape(2, 3))}),
             "config": ConfigRecord({"lr": 0.1}), "metrics": MetricRecord({"loss": 1.5})}
    ours, theirs = plain_record(RecordDict, parts), RecordDict(parts)
    assert type(ours) is RecordDict and list(ours) == list(theirs)
    assert (serde.recorddict_to_proto(ours).SerializeToString(deterministic=True)
            == serde.recorddict_to_proto(theirs).SerializeToString(deterministic=True))
    with pytest.raises(Exception) as ours_bad:
        plain_record(RecordDict, {"x": {"lr": 0.1}})  # a plain dict is no record
    with pytest.raises(Exception) as theirs_bad:
        RecordDict({"x": {"lr": 0.1}})
    assert ours_bad.type is theirs_bad.type


def test_an_arrayrecord_and_array_built_in_one_step_are_flowers():
    """``plain_array`` and ``plain_record(ArrayRecord, ...)`` (the model and the reply on the hot path)
    leave the fields and the "changed" flags Flower's constructors leave: the same object ids, the
    same bytes on the wire, the same deflated objects; a value Flower refuses is refused the same way."""
    from flwr.common import serde

    from fl_rescaled.layout import decode_array, encode_array
    from fl_rescaled.messages import plain_array, plain_record

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    ours, theirs = encode_array(a), Array(a)
    assert type(ours) is Array and ours.__dict__ == theirs.__dict__ and ours == theirs
    assert ours.is_dirty and ours.object_id == theirs.object_id and not ours.is_dirty
    assert ours.deflate() == theirs.deflate() and np.array_equal(decode_array(ours), a)
    rec_ours = plain_record(ArrayRecord, {"w": encode_array(a), "b": encode_array(a[0])})
    rec_theirs = ArrayRecord()
    rec_theirs["w"], rec_theirs["b"] = Array(a), Array(a[0])
    assert type(rec_ours) is ArrayRecord and rec_ours.__dict__.keys() == rec_theirs.__dict__.keys()
    assert rec_ours.is_dirty and rec_theirs.is_dirty and list(rec_ours) == ["w", "b"]
    assert rec_ours.object_id == rec_theirs.object_id and rec_ours.deflate() == rec_theirs.deflate()
    assert (serde.recorddict_to_proto(RecordDict({"arrays": rec_ours})).SerializeToString(deterministic=True)
            == serde.recorddict_to_proto(RecordDict({"arrays": rec_theirs})).SerializeToString(deterministic=True))
    for bad in ({"w": a}, {1: Array(a)}, {"w": None}):  # not an Array, a key that is not a string
        with pytest.raises(Exception) as ours_bad:
            plain_record(ArrayRecord, bad)
        with pytest.raises(Exception) as theirs_bad:
            ArrayRecord(bad)
        assert ours_bad.type is theirs_bad.type
    for args in (("float32", [2, 3], b"x"), ("float32", (2.0, 3), b"x"), (b"float32", (2, 3), b"x"),
                 ("float32", (2, 3), bytearray(b"x"))):  # what Flower's constructor refuses, refused alike
        with pytest.raises(Exception) as ours_bad:
            plain_array(*args)
        with pytest.raises(Exception) as theirs_bad:
            Array(dtype=args[0], shape=args[1], stype="numpy.ndarray", data=args[2])
        assert ours_bad.type is theirs_bad.type


def _same_message(ours, theirs, reply: bool) -> None:
    """Two messages alike to Flower but for their creation times (a reply's TTL ends when its
    instruction's does, so it moves with them): the same fields, metadata, object id and wire bytes
    once the times are made equal."""
    assert type(ours) is Message and ours.__dict__.keys() == theirs.__dict__.keys()
    assert ours.content is theirs.content and not ours.has_error() and ours.has_content()
    mine, flowers = dict(ours.metadata.__dict__), dict(theirs.metadata.__dict__)
    assert abs(mine["_created_at"] - flowers["_created_at"]) < 60
    if reply:
        assert mine["_created_at"] + mine["_ttl"] == pytest.approx(flowers["_created_at"] + flowers["_ttl"], abs=1e-6)
        for m in (mine, flowers):
            del m["_ttl"]
    del mine["_created_at"], flowers["_created_at"]
    assert mine == flowers
    ours.metadata.created_at, ours.metadata.ttl = theirs.metadata.created_at, theirs.metadata.ttl
    assert ours.object_id == theirs.object_id and ours.deflate() == theirs.deflate()


def test_a_message_and_its_reply_built_in_one_step_are_flowers():
    """``plain_message`` and ``plain_reply`` (each job and each reply on the hot path) leave what
    Flower's ``Message`` constructor leaves; arguments its checks refuse, or take only after a
    conversion, go through the constructor itself and are refused (or taken) alike."""
    from flwr.app.message.message import MessageInitializationError

    from fl_rescaled.grid import set_server_identity
    from fl_rescaled.grid_api import set_message_id
    from fl_rescaled.messages import plain_message, plain_reply

    set_server_identity(77)
    content = RecordDict({"config": ConfigRecord({"lr": 0.1})})
    answer = RecordDict({"metrics": MetricRecord({"loss": 1.0})})
    for kw in ({}, {"ttl": 30.0, "group_id": "5"}, {"ttl": 12}, {"group_id": ""}):
        ours, theirs = plain_message(content, 1234, "train", **kw), Message(content, 1234, "train", **kw)
        _same_message(ours, theirs, reply=False)
        set_message_id(ours, "00000000000000ab")
        _same_message(plain_reply(answer, ours), Message(answer, reply_to=ours), reply=True)
    job = plain_message(content, 1234, "train")
    failed = plain_reply(Error(code=0, reason="x"), job)  # (an error reply: Flower's constructor)
    assert failed.has_error() and failed.metadata.reply_to_message_id == job.metadata.message_id
    refused = [({"lr": 0.1}, 1234, "train", {}), (content, np.int64(1234), "train", {}), (content, 1234, 5, {}),
               (content, 1234, "train", {"ttl": "30"}), (content, 1234, "train", {"group_id": 3})]
    for c, node, kind, kw in refused:
        with pytest.raises(MessageInitializationError):
            Message(c, node, kind, **kw)
        with pytest.raises(MessageInitializationError):
            plain_message(c, node, kind, **kw)
    with pytest.raises(MessageInitializationError):
        plain_reply({"x": 1}, job)
    taken = plain_message(content, True, "train")  # (a bool passes Flower's checks: its constructor takes it)
    assert taken.metadata.dst_node_id is True
