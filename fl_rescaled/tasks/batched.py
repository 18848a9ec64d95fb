"""Many jobs of one task in one call: the kernels behind the project ClientApp's batch entry.

Each job has its own model, its own partition and its own random generator (``job_rng``); a batch
stacks the B models into a (B, P) tensor and draws every job's minibatch from its own generator in
the order the job would draw it alone, so a batched reply equals the one-by-one reply up to float
rounding. Where the MLP's products go through oneDNN (``mnist.onednn``) a CPU batch computes its jobs
one at a time with the one-job kernel, so the bits are the same; with torch's BLAS it takes one
``torch.baddbmm``/``bmm`` per layer (on the CPUs we tried bit for bit too: they compute each slice
with the same kernel as ``addmm``/``mm`` on one slice).

``device`` is ``"cpu"``, ``"cuda"`` (``"cuda:1"``) or ``"auto"`` (CUDA when available): the models,
the minibatches and the products go to that device, the training data once per task and device.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .mnist import _SPLITS, MnistTask, mlp_gradient, onednn
from .quadratic import QuadraticTask

DEVICES = ("cpu", "cuda", "auto")
_DATA: dict[tuple[int, str], tuple[Any, Any, Any, Any]] = {}
_DATA_LOCK = threading.Lock()


def resolve_device(device: str | None) -> str:
    """``auto`` → ``cuda`` when torch sees a GPU, else ``cpu``; ``cpu``/``cuda[:i]`` as given."""
    device = (device or "cpu").strip().lower()
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; choose one of {DEVICES}")
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: torch sees no CUDA device here (use cpu or auto)")
    return device


def partition_layout(task: MnistTask) -> tuple[np.ndarray, np.ndarray]:
    """(each partition's first row, sizes) of the partitions laid end to end, as ``device_data`` lays them."""
    key = (id(task), "layout")
    got = _DATA.get(key)
    if got is None:
        sizes = np.asarray(task.partition_sizes(), np.int64)
        got = _DATA[key] = (np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64), sizes)
    return got


def device_data(task: MnistTask, device: str):
    """(all partitions' images end to end, their labels, each partition's first row, sizes) on ``device``."""
    key = (id(task), device)
    got = _DATA.get(key)
    if got is None:
        import torch

        with _DATA_LOCK:
            got = _DATA.get(key)
            if got is None:
                parts = [task.partition(i) for i in range(task.num_workers)]
                starts, sizes = partition_layout(task)
                X = task.images().to(device)  # (on the CPU the task's own tensor: no copy)
                Y = torch.cat([y for _, y in parts]).to(device)
                got = _DATA[key] = (X, Y, starts, sizes)
    return got


def minibatch_rows(starts: np.ndarray, sizes: np.ndarray, workers: Sequence[int],
                   rngs: Sequence[np.random.Generator], batch_size: int) -> np.ndarray:
    """(B, m) rows of every job's minibatch in the partitions laid end to end (each partition's first
    row ``starts``, its size ``sizes``): job j draws ``rng.choice(n_j, m, replace=False)`` from its own
    generator, as ``MnistTask.minibatch``."""
    m = int(batch_size)
    if len(workers) == 1 and int(sizes[workers[0]]) >= m:  # (one job, as each sent to a worker process)
        rows = rngs[0].choice(int(sizes[workers[0]]), m, replace=False).astype(np.int64, copy=False).reshape(1, m)
        rows += starts[workers[0]]
        return rows
    if int(sizes[list(workers)].min()) < m:
        raise ValueError("a partition is smaller than the minibatch: these jobs go one by one")
    rows = np.empty((len(workers), m), np.int64)
    for j, (w, rng) in enumerate(zip(workers, rngs)):
        rows[j] = rng.choice(int(sizes[w]), m, replace=False)
        rows[j] += starts[w]
    return rows


def mnist_minibatches(task: MnistTask, workers: Sequence[int], rngs: Sequence[np.random.Generator],
                      batch_size: int, device: str = "cpu"):
    """Every job's minibatch, stacked: images (B, m, 784) and labels (B, m), on ``device``.

    Job j draws ``rng.choice(n_j, m, replace=False)`` from its own generator, as ``MnistTask.minibatch``.
    """
    import torch

    X, Y, starts, sizes = device_data(task, device)
    rows = minibatch_rows(starts, sizes, workers, rngs, batch_size)
    m = rows.shape[1]
    idx = torch.from_numpy(rows.reshape(-1)).to(device)
    return X.index_select(0, idx).view(len(workers), m, -1), Y.index_select(0, idx).view(len(workers), m)


def one_job_at_a_time(w) -> bool:
    """Whether ``mlp_gradients`` computes the (B, P) models ``w`` one job at a time with ``mlp_gradient``:
    on the CPU with oneDNN, whose products have no batch of weights. ``rows_job`` asks the same, so a
    job computed alone has the bits of the same job in a batch."""
    return w.device.type == "cpu" and onednn()


def mlp_gradients(w, xb, yb, out=None):
    """The MLP's minibatch gradients of B jobs at once: (B, P) flat gradients and (B,) mean losses.

    ``w`` is (B, P) float32 (each row a model ``[W1, b1, W2, b2]``), ``xb`` (B, m, 784), ``yb`` (B, m);
    the same steps as ``mlp_gradient``, one batched product per layer. ``out``: a (B, P) float32 tensor
    with contiguous rows, each starting 64-byte aligned, to write the gradients into; it may be ``w``
    itself (the worker process writes each gradient over its model: every read of the model comes
    before the first write).
    """
    import torch

    B = w.shape[0]
    if one_job_at_a_time(w):
        g = torch.empty(w.shape, dtype=torch.float32) if out is None else out
        losses = [mlp_gradient(w[j], xb[j], yb[j], g[j])[1] for j in range(B)]
        return g, torch.tensor(losses, dtype=torch.float32)
    W1, b1, W2, b2 = w.split(_SPLITS, dim=1)
    W1 = W1.reshape(B, 128, 784)
    W2 = W2.reshape(B, 10, 128)
    m = yb.shape[1]
    h = torch.relu(torch.baddbmm(b1.unsqueeze(1), xb, W1.transpose(1, 2)))
    p = torch.softmax(torch.baddbmm(b2.unsqueeze(1), h, W2.transpose(1, 2)), dim=2)
    y1 = yb.view(B, m, 1)
    py = p.gather(2, y1)
    loss = -torch.log(py.clamp_min(1e-30)).mean(dim=(1, 2))
    p.scatter_(2, y1, py.sub_(1.0))
    p /= m
    dh = torch.bmm(p, W2)  # (the model's last read: ``out`` may be ``w``)
    g = torch.empty(w.shape, dtype=torch.float32, device=w.device) if out is None else out
    gW1, gb1, gW2, gb2 = g.split(_SPLITS, dim=1)
    torch.bmm(p.transpose(1, 2), h, out=gW2.view(B, 10, 128))
    torch.sum(p, 1, out=gb2)
    dh.mul_(torch.sign(h))
    torch.bmm(dh.transpose(1, 2), xb, out=gW1.view(B, 128, 784))
    torch.sum(dh, 1, out=gb1)
    return g, loss


def mnist_jobs(task: MnistTask, xs: Sequence[np.ndarray], workers: Sequence[int],
               rngs: Sequence[np.random.Generator], *, steps: int = 0, lr: float = 0.0, prox: float = 0.0,
               device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """B MNIST jobs: with ``steps`` = 0 their minibatch gradients, else their models after ``steps``
    local SGD steps at ``lr`` (``local_sgd``'s arithmetic). Returns (B, P) float32 and (B,) losses."""
    import torch

    device = resolve_device(device)
    # The models stacked in torch's 64-byte aligned buffer, where the gradients are then written over
    # them (with several threads a product's last bit can follow its output's address: see ``scratch``).
    x = torch.empty((len(xs), task.size), dtype=torch.float32)
    np.stack([np.asarray(v, np.float32) for v in xs], out=x.numpy())
    x = x.to(device)
    if steps <= 0:
        xb, yb = mnist_minibatches(task, workers, rngs, task.batch_size, device)
        g, loss = mlp_gradients(x, xb, yb, out=x)
        return g.cpu().numpy(), loss.double().cpu().numpy()
    batches = (mnist_minibatches(task, workers, rngs, task.batch_size, device) for _ in range(int(steps)))
    y, loss = local_steps(x, batches, lr, prox)
    return y.cpu().numpy(), loss.cpu().numpy()


def rows_job(X, Y, x, rows, batch: int, steps: int, lr: float, prox: float, out=None):
    """One job as the worker process computes it (``kernel_process``, and the caller for a job it
    steals): ``x`` a (1, P) float32 tensor, ``rows`` its minibatches' rows in the images ``X`` and
    labels ``Y``. A gradient (``steps`` = 0, written into ``out`` when given) or the model after
    ``steps`` local SGD steps, as (1, P), and the mean loss."""
    if not steps and one_job_at_a_time(x):  # (``mlp_gradients``' one-job kernel, called directly)
        g = x.new_empty(x.shape) if out is None else out  # (x is float32: the worker's slot, or a copy)
        _, loss = mlp_gradient(x[0], X.index_select(0, rows[0]), Y.index_select(0, rows[0]), g[0])
        return g, loss
    batches = ((X.index_select(0, rows[q]).view(1, batch, -1), Y.index_select(0, rows[q]).view(1, batch))
               for q in range(max(int(steps), 1)))
    if steps:
        y, loss = local_steps(x, batches, lr, prox)
        return y, float(loss[0])
    y, loss = mlp_gradients(x, *next(batches), out=out)
    return y, float(loss.double()[0])


def local_steps(x, batches, lr: float, prox: float):
    """Local SGD from the (B, P) models ``x``, one step per (images, labels) of ``batches``, drawn as
    they are needed: (the (B, P) models after the steps, their (B,) mean losses in float64).
    ``local_sgd``'s arithmetic: Δ accumulates ``lr · (g + prox · (y − x))``, y = x − Δ."""
    import torch

    delta = torch.zeros_like(x)
    y = x
    losses = []
    for xb, yb in batches:
        g, loss = mlp_gradients(y, xb, yb)
        losses.append(loss.double())
        if prox:
            g = g + prox * (y - x)
        delta += lr * g
        y = x - delta
    return y, torch.stack(losses).mean(0)


def quadratic_gradients(task: QuadraticTask, xs: Sequence[np.ndarray], workers: Sequence[int],
                        rngs: Sequence[np.random.Generator | None]) -> tuple[np.ndarray, np.ndarray]:
    """B quadratic gradients 2 a_i (x − b_i) (+ σ·noise from each job's generator) and losses."""
    x = np.stack([np.asarray(v, np.float64) for v in xs])
    w = np.asarray(workers, np.int64)
    a, b = task.a[w][:, None], task.b[w][:, None]
    d = x - b
    g = 2.0 * a * d
    if task.noise > 0:
        g += task.noise * np.stack([rng.standard_normal(task.dim) for rng in rngs])
    return g, a[:, 0] * np.sum(d**2, axis=1)
