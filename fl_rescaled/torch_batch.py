"""A batched ClientApp from a torch model, a loss and each client's data (``torch.func``).

``torch_client_app(model_fn, loss_fn, data_fn)`` returns a ``BatchedClientApp`` whose ``train``
does ``local-steps`` steps of plain SGD (no momentum) from the model it receives and replies with
the trained model, in the message's own ``ArrayRecord`` layout (its ``state_dict`` keys):

- one message at a time (Flower's engine, a deployment) it runs ``nn.Module`` and autograd;
- the in-process Grid answers the jobs in flight in one call: the B received models are stacked
  parameter by parameter and one ``torch.func.vmap`` of ``grad`` of ``functional_call`` computes the
  B minibatch gradients of each step at once, on ``device``. On the CPU the call trains its jobs one
  after the other with the unbatched code instead (the ``vmap`` option; by default ``vmap`` on a GPU
  only): there ``torch.func``'s transforms cost more than they save, for the example app's CNN
  (``vmap`` turns each convolution into a grouped one) and for a 784-128-10 MLP alike (measured: 1.2
  to 1.6 × the CPU time per job of ``nn.Module`` and autograd, 4 or 10 jobs per call). The choice
  depends on the device only, so a run's replies do not depend on how its jobs were grouped.

Both draw step q's minibatch of ``batch_size`` rows without replacement from the client's data with
one generator per job, seeded from (``seed``, partition id, job number): the job number is the
config's ``job-seq`` when the server sends one, else the count of jobs the node has trained (kept in
its context's state, and moved only once a call's replies are made: a batch call that raises, redone
one by one by the Grid, counts nothing). So a job's reply is a function of its message and its
node's history, and the batched reply equals the unbatched one up to float rounding. Torch's own
random numbers (dropout) come from a seed of the same job's (torch's global generator is set back
after the job), so a job with dropout gives the same reply on every run; ``vmap`` refuses random
ops, so with dropout the jobs of a batch call train one after the other (said once in a WARNING).
Buffers are sent back as received, so a model with running statistics
(BatchNorm, or any norm layer with ``track_running_stats``) is refused when it is first built: its
statistics would never move, and its evaluation would be wrong without a word.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from .batching import BatchedClientApp
from .layout import decode_array, encode_array
from .messages import JOB_TYPE, plain_record
from .tasks.batched import resolve_device

log = logging.getLogger("flwr.fl_rescaled")

#: The context state record where a node counts its trained jobs (when messages carry no ``job-seq``).
STATE_KEY = "torch-batch"


def _job_numbers(msgs: Sequence[Message], contexts: Sequence[Context]) -> tuple[list[int], dict]:
    """Each job's number: the config's ``job-seq``, else the next of its node's count (kept in its
    context's state), and the counts to keep once the jobs are answered (``_count``): a batch call that
    raises is redone one by one by the Grid, and must not have counted its jobs already."""
    numbers, counted = [], {}
    for msg, context in zip(msgs, contexts):
        cfg = msg.content["config"] if "config" in msg.content else ConfigRecord()
        if "job-seq" in cfg:
            numbers.append(int(cfg["job-seq"]))
            continue
        rec = context.state.get(STATE_KEY) if STATE_KEY in context.state else None
        seq = counted[id(context)][1] if id(context) in counted else (int(rec["jobs"]) if rec is not None else 0)
        numbers.append(seq)
        counted[id(context)] = (context, seq + 1)
    return numbers, counted


def _count(counted: dict) -> None:
    for context, jobs in counted.values():
        context.state[STATE_KEY] = ConfigRecord({"jobs": jobs})


class _Helper:
    """The pieces both entries share: data per partition, config reading, minibatch rows."""

    def __init__(self, model_fn, loss_fn, data_fn, batch_size, local_steps, lr, seed, device, arrays_key, vmap):
        self.model_fn, self.loss_fn, self.data_fn = model_fn, loss_fn, data_fn
        self.batch_size, self.local_steps, self.lr, self.seed = int(batch_size), int(local_steps), lr, int(seed)
        self.device, self.arrays_key, self.vmap = device, arrays_key, vmap
        self._data: dict[tuple[int, str], tuple[Any, Any]] = {}
        self._checked = False

    def model(self, device: str):
        """A new model on ``device``; the first one is checked for running statistics (see the module)."""
        model = self.model_fn().to(device)
        if not self._checked:
            kept = [f"{f'module {name!r}' if name else 'the model'} ({type(m).__name__})"
                    for name, m in model.named_modules()
                    if getattr(m, "track_running_stats", False) and getattr(m, "running_mean", None) is not None]
            if kept:
                raise ValueError(
                    f"torch_client_app: {', '.join(kept)} keeps running statistics, which this helper does not "
                    "train (replies carry buffers as received: the statistics would never move). Use GroupNorm "
                    "or LayerNorm, or build the norm layers with track_running_stats=False.")
            self._checked = True
        return model

    def batches(self, device: str) -> bool:
        """Whether a batch call trains its jobs with one ``vmap`` (else one after the other)."""
        return bool(self.vmap) if self.vmap is not None else device != "cpu"

    def data(self, context: Context, device: str):
        pid = int(context.node_config.get("partition-id", 0))
        got = self._data.get((pid, device))
        if got is None:
            import torch

            x, y = self.data_fn(context)  # (tensors, or arrays torch can take: numpy's)
            got = self._data[(pid, device)] = (torch.as_tensor(x).to(device), torch.as_tensor(y).to(device))
        return got

    def settings(self, msg: Message) -> tuple[int, float, str]:
        cfg = msg.content["config"] if "config" in msg.content else ConfigRecord()
        steps = int(cfg.get("local-steps", self.local_steps))
        lr = float(cfg.get("local-lr", cfg.get("lr", self.lr)))
        return steps, lr, resolve_device(str(cfg.get("device", self.device)))

    def rows(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(n, min(self.batch_size, n), replace=False)

    def rng(self, context: Context, job: int) -> np.random.Generator:
        """The generator of job number ``job`` (``_job_numbers``) on the node of ``context``."""
        pid = int(context.node_config.get("partition-id", 0))
        return np.random.default_rng((self.seed & 0xFFFFFFFF, 0x7B47, pid, job))

    @staticmethod
    @contextlib.contextmanager
    def seeded(rng: np.random.Generator | None, device: str) -> Iterator[None]:
        """Torch's random numbers (a new model's initial weights, dropout) from a seed of the job's own
        (a child of ``rng``'s seed, so its minibatch draws are untouched; None: not seeded), torch's
        global generators as they were afterwards."""
        import torch

        seed = None
        if rng is not None:  # (63 bits: torch's seeds are signed)
            seed = int(rng.bit_generator.seed_seq.spawn(1)[0].generate_state(1, np.uint64)[0] >> np.uint64(1))
        cuda = []
        if device.startswith("cuda"):
            index = torch.device(device).index
            cuda = [torch.cuda.current_device() if index is None else index]
        with torch.random.fork_rng(devices=cuda):
            if seed is not None:
                torch.default_generator.manual_seed(seed)
                for i in cuda:
                    torch.cuda.default_generators[i].manual_seed(seed)
            yield

    def reply(self, msg: Message, arrays: dict[str, np.ndarray], loss: float, steps: int) -> Message:
        record = plain_record(ArrayRecord, {name: encode_array(value) for name, value in arrays.items()})
        metrics = plain_record(MetricRecord, {"train_loss": float(loss), "num-examples": int(steps * self.batch_size)})
        return Message(plain_record(RecordDict, {self.arrays_key: record, "metrics": metrics}), reply_to=msg)

    def received(self, msg: Message) -> dict[str, np.ndarray]:
        return {k: decode_array(a) for k, a in msg.content[self.arrays_key].items()}


def _train_one(h: _Helper, msg: Message, context: Context) -> Message:
    """The unbatched entry; the node's job count moves once the reply is made."""
    (job,), counted = _job_numbers([msg], [context])
    reply = _trained(h, msg, context, job)
    _count(counted)
    return reply


def _trained(h: _Helper, msg: Message, context: Context, job: int) -> Message:
    """Job number ``job`` with ``nn.Module`` and autograd."""
    import torch

    steps, lr, device = h.settings(msg)
    state = h.received(msg)
    x, y = h.data(context, device)
    rng = h.rng(context, job)
    losses = []
    with h.seeded(rng, device):
        model = h.model(device)
        model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()})
        params = dict(model.named_parameters())
        for _ in range(steps):
            idx = torch.from_numpy(h.rows(rng, int(y.shape[0]))).to(device)
            model.zero_grad(set_to_none=True)
            loss = h.loss_fn(model(x.index_select(0, idx)), y.index_select(0, idx))
            loss.backward()
            with torch.no_grad():
                for p in params.values():
                    p -= lr * p.grad
            losses.append(loss.detach())
    out = {k: (v.detach().cpu().numpy() if k in params else state[k]) for k, v in model.state_dict().items()}
    return h.reply(msg, out, float(torch.stack(losses).double().mean()) if losses else 0.0, steps)


def _train_many(h: _Helper, msgs: Sequence[Message], contexts: Sequence[Context]) -> list[Message]:
    """The batched entry; the nodes' job counts move only when every job of the call is answered."""
    jobs, counted = _job_numbers(msgs, contexts)
    replies = _train_all(h, msgs, contexts, jobs)
    _count(counted)
    return replies


def _train_all(h: _Helper, msgs: Sequence[Message], contexts: Sequence[Context], jobs: list[int]) -> list[Message]:
    """One ``vmap(grad(functional_call))`` per local step for all the jobs (or, on the CPU by default,
    one job after the other with the unbatched code)."""
    import torch
    from torch.func import functional_call, grad_and_value, vmap

    steps, lr, device = h.settings(msgs[0])
    if not h.batches(device):
        return [_trained(h, m, c, j) for m, c, j in zip(msgs, contexts, jobs)]
    with h.seeded(None, device):  # (its initial weights are not used: torch's generator left alone)
        model = h.model(device)
    names = [n for n, _ in model.named_parameters()]
    states = [h.received(m) for m in msgs]
    buffers = {n: torch.from_numpy(np.stack([s[n] for s in states])).to(device) for n, _ in model.named_buffers()}
    start = {n: torch.from_numpy(np.stack([s[n] for s in states])).to(device) for n in names}
    data = [h.data(c, device) for c in contexts]
    rngs = [h.rng(c, j) for c, j in zip(contexts, jobs)]

    def loss_of(params, bufs, xb, yb):
        return h.loss_fn(functional_call(model, (params, bufs), (xb,)), yb)

    step = vmap(grad_and_value(loss_of))
    params = dict(start)
    losses = []
    try:
        for _ in range(steps):
            rows = [torch.from_numpy(h.rows(r, int(y.shape[0]))).to(device) for r, (_, y) in zip(rngs, data)]
            xb = torch.stack([x.index_select(0, i) for (x, _), i in zip(data, rows)])
            yb = torch.stack([y.index_select(0, i) for (_, y), i in zip(data, rows)])
            grads, loss = step(params, buffers, xb, yb)
            params = {n: params[n] - lr * grads[n] for n in names}
            losses.append(loss.detach().double())
    except RuntimeError as exc:  # (a random op, dropout: vmap refuses it; the jobs' own seeds, one by one)
        if "randomness" not in str(exc):
            raise
        h.vmap = False
        log.warning("torch_client_app: the model draws random numbers (dropout), which one vmap of its jobs "
                    "cannot; its jobs train one after the other from now on, with the replies of one by one.")
        return [_trained(h, m, c, j) for m, c, j in zip(msgs, contexts, jobs)]
    mean = torch.stack(losses).mean(0).cpu().numpy() if losses else np.zeros(len(msgs))
    host = {n: v.detach().cpu().numpy() for n, v in params.items()}
    replies = []
    for j, (msg, state) in enumerate(zip(msgs, states)):
        out = {k: (host[k][j] if k in host else v) for k, v in state.items()}
        replies.append(h.reply(msg, out, float(mean[j]), steps))
    return replies


def torch_client_app(model_fn: Callable[[], Any], loss_fn: Callable, data_fn: Callable[[Context], tuple[Any, Any]],
                     *, batch_size: int = 32, local_steps: int = 1, lr: float = 0.01, seed: int = 0,
                     device: str = "cpu", arrays_key: str = "arrays", chunk: int | None = None,
                     vmap: bool | None = None) -> BatchedClientApp:
    """A ClientApp that trains a torch model with local SGD, batched across jobs in process.

    Parameters
    ----------
    model_fn : callable
        Builds the ``nn.Module`` (its ``state_dict`` keys are the messages' ``ArrayRecord`` keys).
    loss_fn : callable
        ``loss_fn(outputs, targets)``, a scalar mean over the minibatch (``F.cross_entropy``).
    data_fn : callable
        ``data_fn(context)``: the node's training (inputs, targets), tensors or arrays (numpy's);
        called once per partition.
    batch_size, local_steps, lr : int, int, float
        Rows per minibatch, SGD steps per job (positive integers), learning rate (positive, finite);
        a job config's ``local-steps`` and ``local-lr`` or ``lr`` override the last two.
    seed : int
        Seeds the minibatch draws (with the partition id and the job number).
    device : str
        ``cpu``, ``cuda`` or ``auto`` (a job config's ``device`` overrides it).
    arrays_key : str
        The content key of the model's ``ArrayRecord`` in messages and replies.
    chunk : int, optional
        At most this many jobs per batched call (None: all the jobs in flight at once).
    vmap : bool, optional
        Whether a batched call trains its jobs with one ``torch.func.vmap`` per step (True) or one
        after the other with the unbatched code (False). None (default): ``vmap`` on a GPU, one
        after the other on the CPU (where ``vmap`` was measured slower).

    Returns
    -------
    BatchedClientApp
        Register an ``@app.evaluate()`` function on it as on any ClientApp.
    """
    for name, value in (("batch_size", batch_size), ("local_steps", local_steps)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    h = _Helper(model_fn, loss_fn, data_fn, batch_size, local_steps, lr, seed, device, arrays_key, vmap)
    app = BatchedClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return _train_one(h, msg, context)

    def key(msg: Message):
        if msg.metadata.message_type != JOB_TYPE or h.arrays_key not in msg.content:
            return None
        return h.settings(msg)

    @app.batch(key=key, chunk=chunk)
    def train_many(msgs: Sequence[Message], contexts: Sequence[Context]) -> list[Message]:
        return _train_many(h, msgs, contexts)

    return app
