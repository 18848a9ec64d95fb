"""The wire convention between an asynchronous strategy and a ClientApp: Flower's own.

A **job** is a normal ``train`` Message, as Flower's FedAvg sends it:

- ``content[arrayrecord_key]`` (default ``"arrays"``): the model, in the layout the user gave as
  ``initial_arrays`` (same keys, shapes and dtypes);
- ``content[configrecord_key]`` (default ``"config"``): the user's ``train_config`` plus the job's
  tags: ``job-id``, ``worker``, ``version`` (server updates the model has seen), ``job-seq`` (the
  worker's job number) and ``server-round`` (version + 1).

A **reply** is what a FedAvg ClientApp sends: one ArrayRecord in the same layout (a gradient or the
trained model, see the strategies' ``reply`` option) and a MetricRecord. It is matched to its job by
Flower's ``reply_to_message_id``; the client echoes nothing. The client manager validates it
(``fl_rescaled.manager.manager.read_reply``).

The **partition query** (``query.hello``) is optional: a ClientApp that answers it (one line:
``add_partition_query(app)``) tells the server which partition it holds, so workers are numbered by
``partition-id`` whatever the node ids are, and a restarted SuperNode is recognised as the same worker.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, Metadata, MetricRecord, RecordDict
from flwr.app.constants import DEFAULT_TTL
from flwr.clientapp import ClientApp
from flwr.supercore.date import now
from flwr.supercore.task_identity import TaskIdentity

from .errors import one_line

log = logging.getLogger("flwr.fl_rescaled")


JOB_TYPE = "train"
EVALUATE_TYPE = "evaluate"
HELLO_TYPE = "query.hello"


def job_content(arrays: ArrayRecord, config: dict[str, Any], arrayrecord_key: str = "arrays",
                configrecord_key: str = "config") -> RecordDict:
    return plain_record(RecordDict, {arrayrecord_key: arrays,
                                     configrecord_key: plain_record(ConfigRecord, config)})


#: The exact value types each record takes as they are (Flower's ``ConfigScalar`` and
#: ``MetricScalar``; a RecordDict's records).
_SCALARS: dict[type, frozenset[type]] = {ConfigRecord: frozenset((int, float, str, bytes, bool)),
                                          MetricRecord: frozenset((int, float)),
                                          RecordDict: frozenset((ArrayRecord, ConfigRecord, MetricRecord)),
                                          ArrayRecord: frozenset((Array,))}


def plain_record(cls: type[ConfigRecord] | type[MetricRecord] | type[RecordDict] | type[ArrayRecord],
                 values: dict[str, Any]) -> Any:
    """``cls(values)`` for a ConfigRecord, MetricRecord, RecordDict or ArrayRecord, built in one step
    when every key is a ``str`` and every value's exact type is one the record takes (values Flower's
    checks would pass: a job's config, model and content, a reply's arrays, metrics and content, each
    update); anything else (a list, a subclass, a wrong type) goes through ``cls(values)`` and so
    through Flower's own checks. Flower's per-item check costs about 3 µs a value on our machine, most
    of the cost of building a job's records (29 µs for a job's config of 8 values, 1 µs this way). An
    ArrayRecord is left marked changed, as its ``__setitem__`` leaves it."""
    scalars = _SCALARS[cls]
    rec = cls()
    data = rec.__dict__.get("_data")
    if type(data) is dict and all(type(k) is str and type(v) in scalars for k, v in values.items()):
        data.update(values)
        if cls is ArrayRecord:
            rec.__dict__["_is_dirty"] = True
        return rec
    return cls(values)


def plain_array(dtype: str, shape: tuple[int, ...], data: bytes) -> Array:
    """``Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)`` in one step: the same
    fields and the same "changed" flag as Flower's constructor leaves, without its argument
    dispatch and four tracked assignments (5 µs an Array on our machine, 0.4 this way; two per
    update). Only for values Flower's constructor takes as they are (a ``str``, a tuple of ``int``,
    ``bytes``); anything else goes through the constructor and its checks."""
    if type(dtype) is str and type(shape) is tuple and type(data) is bytes and all(type(s) is int for s in shape):
        arr = Array.__new__(Array)
        arr.__dict__.update(_is_dirty=True, dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)
        return arr
    return Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)


def plain_message(content: RecordDict, dst_node_id: int, message_type: str, *, ttl: float | None = None,
                  group_id: str | None = None) -> Message:
    """``Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)`` (an instruction: a
    job) with the same metadata, built without the constructor's argument dispatch and type checks
    (4.3 µs a job's message on our machine, 2.7 this way; one job and one reply per update). Only for
    arguments of the exact types those checks pass as they are; anything else goes through Flower's
    constructor and its checks."""
    if (type(content) is RecordDict and type(dst_node_id) is int and type(message_type) is str
            and (ttl is None or type(ttl) in (int, float)) and (group_id is None or type(group_id) is str)):
        return _message(Metadata(TaskIdentity.run_id, "", TaskIdentity.node_id, dst_node_id, "", group_id or "",
                                 now().timestamp(), ttl or DEFAULT_TTL, message_type, TaskIdentity.task_id, None),
                        content)
    return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)


def plain_reply(content: RecordDict, reply_to: Message) -> Message:
    """``Message(content, reply_to=reply_to)`` in one step, as ``plain_message``: the reply's metadata
    mirrors the instruction's and its TTL ends when the instruction's does, as Flower sets them (6.4 µs
    a reply on our machine, 3.6 this way). Anything but a ``RecordDict`` replying to a ``Message`` goes
    through Flower's constructor."""
    if type(content) is RecordDict and type(reply_to) is Message:
        md = reply_to.metadata
        current = now().timestamp()
        return _message(Metadata(md.run_id, "", md.dst_node_id, md.src_node_id, md.message_id, md.group_id, current,
                                 md.created_at + md.ttl - current, md.message_type, md.dst_task_id,
                                 md.src_task_id), content)
    return Message(content, reply_to=reply_to)


def _message(metadata: Metadata, content: RecordDict) -> Message:
    """The message Flower's constructor leaves: its three fields, no error."""
    metadata.delivered_at = ""
    msg = Message.__new__(Message)
    msg.__dict__.update(_metadata=metadata, _content=content, _error=None)
    return msg


#: Metric keys with a meaning of their own: a count of examples and a compute time in seconds.
NUM_EXAMPLES, COMPUTE_TIME = "num-examples", "compute-time"
_FLOAT_MAX = int(sys.float_info.max)
#: The longest list a metric may be (per-class accuracies, say): a longer one is dropped, so that a
#: reply cannot make the history of every evaluation window megabytes long.
MAX_METRIC_LIST = 1000
_dropped: set[tuple[str, str]] = set()  # (key, reason) already logged


def reply_metrics(content: RecordDict) -> dict[str, Any]:
    """The metrics of a reply, validated: the one reader of a reply's metrics, on every path
    (accepted, cancelled, late, federated evaluation).

    Every MetricRecord's entries (normally there is one, ``metrics``). Kept: numbers (int or float,
    not bool) that are finite as floats, and lists of them (Flower's FedAvg aggregates
    ``list[float]`` metrics), as plain Python values; ``num-examples`` only as a non-negative
    integer-valued number (kept as an int); ``compute-time`` only finite and ≥ 0 (the caller clamps
    it to what the server observed). Dropped, with the reason logged once per key and reason: NaN,
    ±inf, a bad count or time, a list of more than ``MAX_METRIC_LIST`` values, any other type, and
    keys that start with ``$`` (reserved by the checkpoint format). ConfigRecords and ArrayRecords are not metrics and are not read here.
    """
    out: dict[str, Any] = {}
    for record in content.values():
        if not isinstance(record, MetricRecord):
            continue
        for key, value in record.items():
            kept, why = metric_value(key, value)
            if why:
                _drop(key, why)
            else:
                out[key] = kept
    return out


def metric_value(key: str, value: Any) -> tuple[Any, str]:
    """(the value to keep, "") or (None, why it is dropped) for one metric of a reply."""
    if not isinstance(key, str) or key.startswith("$"):
        return None, "a metric name may not start with '$'"
    if isinstance(value, list):
        if len(value) > MAX_METRIC_LIST:
            return None, f"a list of metrics may hold at most {MAX_METRIC_LIST} values"
        if all(_finite_number(v) for v in value):
            return [_plain(v) for v in value], ""
        return None, "a list of metrics must hold finite numbers only"
    if not _finite_number(value):
        return None, "not a finite number"
    if key == NUM_EXAMPLES and not (value >= 0 and float(value).is_integer()):
        return None, "the number of examples must be a non-negative integer"
    if key == COMPUTE_TIME and not value >= 0:
        return None, "a compute time must be non-negative"
    return (int(value) if key == NUM_EXAMPLES else _plain(value)), ""


def _finite_number(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return -_FLOAT_MAX <= v <= _FLOAT_MAX if isinstance(v, int) else math.isfinite(v)


def _plain(v: int | float) -> int | float:
    return int(v) if isinstance(v, int) else float(v)


def _drop(key: Any, why: str) -> None:
    if (str(key), why) not in _dropped and len(_dropped) < 1000:
        _dropped.add((str(key), why))
        log.warning("a reply's metric %s was dropped: %s", one_line(repr(key), 80), why)


# ---------------------------------------------------------------------------- the partition query
def hello_message(node_id: int, ttl: float) -> Message:
    """The ``query.hello`` that asks a node which partition (worker index) it holds."""
    return Message(RecordDict({"config": ConfigRecord({"hello": 1})}), node_id, HELLO_TYPE, ttl=ttl)


def parse_hello(reply: Message) -> int | None:
    """The partition id a node answered with, or None for an error or a malformed reply."""
    try:
        if reply.has_content() and "hello" in reply.content:
            return int(reply.content["hello"]["partition-id"])
    except (KeyError, TypeError, ValueError):
        pass
    return None


def answer_hello(msg: Message, context: Context) -> Message:
    """A ClientApp's answer to the partition query: its node config's ``partition-id``."""
    info = {"partition-id": int(context.node_config.get("partition-id", 0))}
    if "num-partitions" in context.node_config:
        info["num-partitions"] = int(context.node_config["num-partitions"])
    return Message(RecordDict({"hello": MetricRecord(info)}), reply_to=msg)


def add_partition_query(app: ClientApp) -> ClientApp:
    """Let ``app`` answer the server's partition query (``query.hello``); returns ``app``.

    One line in a ClientApp module: ``add_partition_query(app)``. Needed only when the server
    numbers workers by partition (per-partition ``taus`` or ``weights``, or nodes that restart).
    """
    app.query("hello")(answer_hello)
    return app
