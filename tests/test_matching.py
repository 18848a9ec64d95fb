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

    res = s.start(grid, X0, num_updates=30, clock=VirtualClock(DelayModel([1.0, 1.3, 1.7])),
                  observers=[OnEvent(on_event)])
    return res.arrays["w"].numpy(), s.last_run.manager.books, events


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


