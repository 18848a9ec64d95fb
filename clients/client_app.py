"""The ClientApp: one stochastic gradient of the node's own objective per ``train`` message.

A job message carries the model (one flat array) and a config naming the task and the job
(see ``fl_rescaled.messages``). All randomness of a job comes from (run seed, partition id, job
number), so the same job gives the same gradient on any transport and in any process.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_rescaled.messages import MODEL_KEY, decode_vector, reply_content
from fl_rescaled.tasks import get_task, job_rng, local_sgd, scratch

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


def _emulate_compute_time(kind: str, cfg: ConfigRecord, context: Context, seed: int, pid: int, seq: int,
                          t0: float) -> None:
    """Make this job take τ_i time units in all (fixed) or an Exp(mean τ_i) draw (exponential).

    τ_i comes from the node config key ``tau`` when the node sets it, else from the job config.
    The draw has its own generator, so the gradient's randomness is the same with or without it.
    """
    tau = float(context.node_config.get("tau", cfg.get("tau", 1.0)))
    unit = float(cfg.get("time-unit", 1.0))
    if kind == "exponential":
        tau = float(np.random.default_rng((seed & 0xFFFFFFFF, 0xE3A1, pid, seq)).exponential(tau))
    remaining = tau * unit - (time.perf_counter() - t0)
    if remaining > 0:
        time.sleep(remaining)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Compute one stochastic gradient at the received model and send it back.

    With ``mode = "local"`` in the config, run ``local-steps`` SGD steps at ``local-lr`` (with
    proximal weight ``prox``) instead and send back the model delta Δ = x − y_Q.
    """
    t0 = time.perf_counter()
    content = msg.content
    cfg: ConfigRecord = content["config"]
    task = get_task(str(cfg["task"]))
    pid = partition_id(context)
    x = decode_vector(content["arrays"][MODEL_KEY])
    rng = job_rng(task, pid, int(cfg["job-seq"]))
    if cfg.get("mode", "gradient") == "local":
        grad, loss = local_sgd(task, x, pid, rng, int(cfg["local-steps"]), float(cfg["local-lr"]),
                               float(cfg.get("prox", 0.0)))
    elif task.name == "mnist":
        # The reply copies the gradient, so one buffer per thread can take every job's gradient.
        grad, loss = task.gradient(x, pid, rng, task.batch_size, out=scratch("gradient", task.size))
    else:
        grad, loss = task.gradient(x, pid, rng, task.batch_size)
    emulate = cfg.get("emulate", "")
    if emulate:
        _emulate_compute_time(str(emulate), cfg, context, task.seed, pid, int(cfg["job-seq"]), t0)
    metrics = {
        "loss": float(loss),
        "batch-size": task.batch_size,
        "job-id": int(cfg["job-id"]),
        "compute-time": time.perf_counter() - t0,
    }
    return Message(reply_content(grad, metrics), reply_to=msg)
