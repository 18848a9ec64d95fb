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

from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp


JOB_TYPE = "train"
EVALUATE_TYPE = "evaluate"
HELLO_TYPE = "query.hello"


def job_content(arrays: ArrayRecord, config: dict[str, Any], arrayrecord_key: str = "arrays",
                configrecord_key: str = "config") -> RecordDict:
    return RecordDict({arrayrecord_key: arrays, configrecord_key: ConfigRecord(config)})


def reply_metrics(content: RecordDict) -> dict[str, Any]:
    """The reply's metrics (every MetricRecord's entries; normally there is one, ``metrics``)."""
    records = [v for v in content.values() if isinstance(v, MetricRecord)]
    if len(records) == 1:
        return dict(records[0])
    out: dict[str, Any] = {}
    for rec in records:
        out.update(rec)
    return out


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
