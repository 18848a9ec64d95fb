"""The project's ClientApp: one stochastic gradient (or H local SGD steps) of the node's own objective.

It speaks Flower's convention (``fl_rescaled.messages``): a ``train`` message carries the model as an
ArrayRecord (the tasks here use one flat array) and a config naming the task and the job; the reply
carries an ArrayRecord in the same layout and a MetricRecord (``loss``, ``num-examples``,
``compute-time``). In gradient mode the arrays are the minibatch gradient; with ``mode = "local"`` in
the config they are the model after ``local-steps`` SGD steps at ``local-lr`` (a FedAvg-style reply,
for strategies with ``reply="model"``).

All randomness of a job comes from (run seed, partition id, job number), so the same job gives the
same reply on any transport and in any process.

The app is a ``BatchedClientApp``: Flower's runtimes call ``train`` one message at a time, the
in-process Grid answers the MNIST and quadratic jobs in flight with ``train_many`` in one call
(``fl_rescaled.tasks.batched``: the same replies up to float rounding), and with ``workers`` ≥ 2 it
sends each CPU MNIST job to a worker process when it is pushed (``launch``:
``fl_rescaled.tasks.kernel_process``, the same bits). ``device`` in the job config
(``cpu``, ``cuda``, ``auto``; the ``--device`` option) says where the MNIST kernels run.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fl_rescaled.batching import BatchedClientApp
from fl_rescaled.layout import decode_array, encode_array
from fl_rescaled.messages import JOB_TYPE, add_partition_query, plain_record, plain_reply
from fl_rescaled.tasks import MnistTask, QuadraticTask, get_task, job_rng, local_sgd, scratch
from fl_rescaled.tasks.batched import (device_data, minibatch_rows, mnist_jobs, partition_layout, quadratic_gradients,
                                       resolve_device, rows_job)
from fl_rescaled.tasks.kernel_process import worker_for

app = BatchedClientApp()
add_partition_query(app)
#: MNIST jobs per batch call on the CPU (the calls of one batch run in parallel with --workers ≥ 2)
CPU_CHUNK = 4


def job_model(msg: Message) -> tuple[tuple[str, str], np.ndarray]:
    """The job's model: ((its ArrayRecord's key, its array's key), the flat array). The tasks here keep
    their model in one flat array."""
    content = msg.content
    arrays_key = next(k for k, v in content.items() if isinstance(v, ArrayRecord))
    (key, arr), = content[arrays_key].items()
    return (arrays_key, key), decode_array(arr)


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
    cfg: ConfigRecord = msg.content["config"]
    task = get_task(str(cfg["task"]))
    pid = partition_id(context)
    keys, x = job_model(msg)
    seq = int(cfg["job-seq"])
    rng = job_rng(task, pid, seq) if getattr(task, "needs_rng", True) else None
    device = resolve_device(str(cfg.get("device", "cpu")))
    if device != "cpu" and type(task) is MnistTask:  # (the batched kernels, one job)
        steps = int(cfg["local-steps"]) if cfg.get("mode", "gradient") == "local" else 0
        outs, losses = mnist_jobs(task, [x], [pid], [rng], steps=steps, lr=float(cfg.get("local-lr", 0.0)),
                                  prox=float(cfg.get("prox", 0.0)), device=device)
        out, loss, examples = outs[0], losses[0], max(steps, 1) * task.batch_size
    elif cfg.get("mode", "gradient") == "local":
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
    return _reply(msg, keys, np.asarray(out), loss, examples, time.perf_counter() - t0)


def batch_key(msg: Message):
    """Jobs of one task, mode and device share a call; emulated compute times and other tasks go one by one."""
    if msg.metadata.message_type != JOB_TYPE:
        return None
    cfg = msg.content["config"]
    if cfg.get("emulate", ""):
        return None
    spec, mode = str(cfg["task"]), str(cfg.get("mode", "gradient"))
    task = get_task(spec)
    if type(task) is MnistTask:
        device = resolve_device(str(cfg.get("device", "cpu")))
        if mode == "local":
            return spec, mode, int(cfg["local-steps"]), float(cfg["local-lr"]), float(cfg.get("prox", 0.0)), device
        return spec, mode, device
    if type(task) is QuadraticTask and mode != "local":
        return spec, mode
    return None


def batch_chunk(msg: Message) -> int | None:
    """CPU MNIST jobs in calls of at most ``CPU_CHUNK`` (spread over the Grid's threads); one call on a GPU."""
    key = batch_key(msg)
    return CPU_CHUNK if key is not None and key[-1] == "cpu" else None


class _InWorker:
    """A CPU MNIST job (a gradient, or local SGD steps) sent to the task's worker process when it was pushed.
    When its reply is wanted before the worker has started it, this process computes it instead, with
    the worker's own function (``batched.rows_job``) and so the same bits."""

    __slots__ = ("msg", "worker", "slot", "keys", "task", "x", "rows", "job", "t0")

    def __init__(self, msg: Message, worker, slot: int, keys: tuple[str, str], task: MnistTask, x: np.ndarray,
                 rows: np.ndarray, job: tuple[int, float, float], t0: float) -> None:
        self.msg, self.worker, self.slot, self.keys, self.task = msg, worker, slot, keys, task
        self.x, self.rows, self.job, self.t0 = x, rows, job, t0

    def reply(self) -> Message:
        examples = max(self.job[0], 1) * self.task.batch_size
        got = self.worker.result(self.slot, steal=True, use=lambda grad, loss: _reply(
            self.msg, self.keys, grad, loss, examples, time.perf_counter() - self.t0))
        if got is None:  # not started there: computed here
            import torch

            X, Y, _, _ = device_data(self.task, "cpu")
            x = torch.from_numpy(np.array(self.x, np.float32)).view(1, -1)
            y, loss = rows_job(X, Y, x, torch.from_numpy(self.rows), self.task.batch_size, *self.job)
            got = _reply(self.msg, self.keys, y.numpy()[0], loss, examples, time.perf_counter() - self.t0)
        return got

    def cancel(self) -> None:
        self.worker.abandon(self.slot)


def launch(msg: Message, context: Context) -> _InWorker | None:
    """Start a CPU MNIST job (a gradient or local SGD steps) in the task's worker process
    (``fl_rescaled.tasks.kernel_process``); None for any other job, or when no worker can take it
    (it then waits for its batch)."""
    t0 = time.perf_counter()
    cfg: ConfigRecord = msg.content["config"]
    if cfg.get("emulate", ""):
        return None
    steps = int(cfg["local-steps"]) if cfg.get("mode", "gradient") == "local" else 0
    spec = str(cfg["task"])
    task = get_task(spec)
    if type(task) is not MnistTask or resolve_device(str(cfg.get("device", "cpu"))) != "cpu":
        return None
    import torch  # (loaded: the task is MNIST)

    if torch.get_num_threads() != 1:  # (the worker computes on one thread: the run's batches keep the bits then)
        return None
    worker = worker_for(spec, task.size, task.batch_size)
    if worker is None:
        return None
    pid = partition_id(context)
    keys, x = job_model(msg)
    starts, sizes = partition_layout(task)
    rng = job_rng(task, pid, int(cfg["job-seq"]))  # (a step's rows after the last step's, as mnist_jobs draws them)
    rows = minibatch_rows(starts, sizes, [pid] * max(steps, 1), [rng] * max(steps, 1), task.batch_size)
    job = (steps, float(cfg.get("local-lr", 0.0)), float(cfg.get("prox", 0.0)))
    slot = worker.submit(x, rows, *job)
    return None if slot is None else _InWorker(msg, worker, slot, keys, task, x, rows, job, t0)


def _reply(msg: Message, keys: tuple[str, str], out: np.ndarray, loss: float, examples: int,
           seconds: float) -> Message:
    """``train``'s reply: the array in the job's layout and the three metrics."""
    arrays_key, key = keys
    record = plain_record(ArrayRecord, {key: encode_array(out)})
    metrics = {"loss": float(loss), "num-examples": int(examples), "compute-time": seconds}
    return plain_reply(plain_record(RecordDict, {arrays_key: record, "metrics": plain_record(MetricRecord, metrics)}),
                       msg)


@app.batch(key=batch_key, chunk=batch_chunk, launch=launch)
def train_many(msgs: list[Message], contexts: list[Context]) -> list[Message]:
    """Answer many ``train`` messages of one batch key at once (``train``'s replies, up to rounding)."""
    t0 = time.perf_counter()
    cfg: ConfigRecord = msgs[0].content["config"]
    task = get_task(str(cfg["task"]))
    pids = [partition_id(c) for c in contexts]
    keys, xs, rngs = [], [], []
    for msg, pid in zip(msgs, pids):
        k, x = job_model(msg)
        keys.append(k)
        xs.append(x)
        seq = int(msg.content["config"]["job-seq"])
        rngs.append(job_rng(task, pid, seq) if getattr(task, "needs_rng", True) else None)
    if type(task) is QuadraticTask:
        outs, losses = quadratic_gradients(task, xs, pids, rngs)
        examples = task.batch_size
    elif cfg.get("mode", "gradient") == "local":
        steps = int(cfg["local-steps"])
        outs, losses = mnist_jobs(task, xs, pids, rngs, steps=steps, lr=float(cfg["local-lr"]),
                                  prox=float(cfg.get("prox", 0.0)), device=str(cfg.get("device", "cpu")))
        examples = steps * task.batch_size
    else:
        outs, losses = mnist_jobs(task, xs, pids, rngs, device=str(cfg.get("device", "cpu")))
        examples = task.batch_size
    share = (time.perf_counter() - t0) / len(msgs)
    return [_reply(msg, k, out, loss, examples, share) for msg, k, out, loss in zip(msgs, keys, outs, losses)]
