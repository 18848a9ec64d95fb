"""The ClientApp: one stochastic gradient of the node's own objective per ``train`` message.

A job message carries the model (one flat array) and a config naming the task and the job
(see ``fl_rescaled.messages``). All randomness of a job comes from (run seed, partition id, job
number), so the same job gives the same gradient on any transport and in any process.
"""

from __future__ import annotations

import time

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_rescaled.messages import MODEL_KEY, decode_vector, reply_content
from fl_rescaled.tasks import client_rng, get_task

app = ClientApp()


def partition_id(context: Context) -> int:
    return int(context.node_config.get("partition-id", 0))


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    """Tell the server which partition (worker index) this node holds."""
    info = {"partition-id": partition_id(context)}
    if "num-partitions" in context.node_config:
        info["num-partitions"] = int(context.node_config["num-partitions"])
    return Message(RecordDict({"hello": MetricRecord(info)}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Compute one stochastic gradient at the received model and send it back."""
    t0 = time.perf_counter()
    cfg: ConfigRecord = msg.content["config"]
    task = get_task(str(cfg["task"]))
    pid = partition_id(context)
    x = decode_vector(msg.content["arrays"][MODEL_KEY])
    rng = client_rng(task.seed, pid, int(cfg["job-seq"]))
    grad, loss = task.gradient(x, pid, rng, task.batch_size)
    metrics = {
        "loss": float(loss),
        "batch-size": task.batch_size,
        "job-id": int(cfg["job-id"]),
        "compute-time": time.perf_counter() - t0,
    }
    return Message(reply_content(grad, metrics), reply_to=msg)
