"""The project's ClientApp: one stochastic gradient (or H local SGD steps) of the node's own objective.

It speaks Flower's convention (``fl_rescaled.messages``): a ``train`` message carries the model as an
ArrayRecord (the tasks here use one flat array) and a config naming the task and the job; the reply
carries an ArrayRecord in the same layout and a MetricRecord (``loss``, ``num-examples``,
``compute-time``). In gradient mode the arrays are the minibatch gradient; with ``mode = "local"`` in
the config they are the model after ``local-steps`` SGD steps at ``local-lr`` (a FedAvg-style reply,
for strategies with ``reply="model"``).

All randomness of a job comes from (run seed, partition id, job number), so the same job gives the
same reply on any transport and in any process.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_rescaled.layout import decode_array, encode_array
from fl_rescaled.messages import add_partition_query
from fl_rescaled.tasks import get_task, job_rng, local_sgd, scratch

app = ClientApp()
add_partition_query(app)


def partition_id(context: Context) -> int:
    return int(context.node_config.get("partition-id", 0))


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
    """Compute one stochastic gradient at the received model (or train locally) and reply."""
    t0 = time.perf_counter()
    content = msg.content
    cfg: ConfigRecord = content["config"]
    task = get_task(str(cfg["task"]))
    pid = partition_id(context)
    arrays_key = next(k for k, v in content.items() if isinstance(v, ArrayRecord))
    (key, arr), = content[arrays_key].items()  # the tasks here keep their model in one flat array
    x = decode_array(arr)
    seq = int(cfg["job-seq"])
    rng = job_rng(task, pid, seq) if getattr(task, "needs_rng", True) else None
    if cfg.get("mode", "gradient") == "local":
        steps = int(cfg["local-steps"])
        delta, loss = local_sgd(task, x, pid, rng, steps, float(cfg["local-lr"]), float(cfg.get("prox", 0.0)))
        out, examples = x - delta, steps * task.batch_size  # the trained model y = x − Δ
    elif task.name == "mnist":
        # The reply copies the gradient, so one buffer per thread can take every job's gradient.
        out, loss = task.gradient(x, pid, rng, task.batch_size, out=scratch("gradient", task.size))
        examples = task.batch_size
    else:
        out, loss = task.gradient(x, pid, rng, task.batch_size)
        examples = task.batch_size
    emulate = cfg.get("emulate", "")
    if emulate:
        _emulate_compute_time(str(emulate), cfg, context, task.seed, pid, seq, t0)
    metrics = {"loss": float(loss), "num-examples": int(examples), "compute-time": time.perf_counter() - t0}
    reply = ArrayRecord()
    reply[key] = encode_array(np.asarray(out))
    return Message(RecordDict({arrays_key: reply, "metrics": MetricRecord(metrics)}), reply_to=msg)
