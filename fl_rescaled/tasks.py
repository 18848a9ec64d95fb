"""Learning tasks: what a worker's stochastic gradient is, and how the global objective is scored.

- ``quadratic``: F_i(x) = a_i · ‖x − b_i‖² (every coordinate), optional Gaussian gradient noise σ.
  The minimiser of Σ w_i F_i is x* = Σ w_i a_i b_i / Σ w_i a_i, so fixed points can be checked
  exactly.
- ``mnist``: the paper's MLP 784 → 128 (ReLU) → 10 with cross-entropy, one minibatch per gradient,
  on worker i's label partition. The model is one flat float32 vector [W1, b1, W2, b2] (row-major,
  PyTorch's ``nn.Linear`` layout); its gradient is computed by hand with torch kernels, which is
  checked against autograd in the tests.

A task is fully described by a small config dict (the keys the server puts in every job's
``ConfigRecord``), so the ClientApp can rebuild it in any process; ``get_task`` caches tasks per
config so in-process clients share one copy of the data.
"""

from __future__ import annotations

import json
import math
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

TASKS = ("mnist", "quadratic")

# Received models are read-only views of the message bytes; the gradient code never writes them.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

# Config keys that define a task (everything else in a job config is per-job).
TASK_KEYS = (
    "task",
    "seed",
    "num-partitions",
    "batch-size",
    "dirichlet-alpha",
    "data-dir",
    "quad-a",
    "quad-b",
    "quad-dim",
    "noise",
    "weights",
    "replica-seeds",
)


#: Byte alignment of every buffer a gradient kernel reads its weights from or writes into.
ALIGN = 64
_SCRATCH = threading.local()


def aligned_empty(size: int, dtype=np.float32) -> np.ndarray:
    """An uninitialised 1-D array whose data starts on an ``ALIGN``-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(size * dtype.itemsize + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + size * dtype.itemsize].view(dtype)


def scratch(name: str, size: int) -> np.ndarray:
    """This thread's aligned float32 buffer ``name`` of ``size`` elements (reused between jobs).

    With several threads, BLAS splits a product's output between them, and how it does so (so
    the rounding of the result) can depend on the output's address: on this machine a product
    written to a buffer that is 8 but not 16 bytes aligned differs in the last bit from one
    written to an aligned buffer. Every gradient is therefore computed into such a buffer.
    """
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.shape[0] != size:
        buf = aligned_empty(size)
        setattr(_SCRATCH, name, buf)
    return buf


def client_rng(seed: int, partition: int, job_seq: int) -> np.random.Generator:
    """The generator of one job: a pure function of (run seed, partition id, job number)."""
    return np.random.default_rng(((int(seed) & 0xFFFFFFFF) << 64) | (int(partition) << 40) | int(job_seq))


def job_rng(task, partition: int, job_seq: int):
    """What ``task.gradient`` takes as its randomness for one job (a list, one per replica, for
    a ``ReplicaTask`` with several seeds)."""
    if isinstance(task, ReplicaTask) and not task.shared:
        return [client_rng(s, partition, job_seq) for s in task.replica_seeds]
    return client_rng(task.seed, partition, job_seq)


class QuadraticTask:
    name = "quadratic"

    def __init__(
        self,
        a: Sequence[float],
        b: Sequence[float],
        dim: int = 1,
        noise: float = 0.0,
        weights: Sequence[float] | None = None,
    ) -> None:
        if len(a) != len(b) or not a:
            raise ValueError("quad-a and quad-b need one value per worker")
        if any(x <= 0 for x in a):
            raise ValueError("quad-a values must be positive")
        if noise < 0:
            raise ValueError("noise must be non-negative")
        self.a = np.asarray(a, dtype=np.float64)
        self.b = np.asarray(b, dtype=np.float64)
        self.dim = int(dim)
        self.noise = float(noise)
        n = len(a)
        self.weights = np.full(n, 1.0 / n) if weights is None else np.asarray(weights, np.float64)
        self.minimizer = float(np.sum(self.weights * self.a * self.b) / np.sum(self.weights * self.a))

    @property
    def num_workers(self) -> int:
        return len(self.a)

    @property
    def size(self) -> int:
        return self.dim

    def initial_params(self, seed: int = 0, x0: float = 0.0) -> np.ndarray:
        del seed
        return np.full(self.dim, float(x0), dtype=np.float64)

    def local_loss(self, x: np.ndarray, worker: int) -> float:
        return float(self.a[worker] * np.sum((x - self.b[worker]) ** 2))

    def gradient(self, x: np.ndarray, worker: int, rng: np.random.Generator, batch_size: int = 0):
        del batch_size
        g = 2.0 * self.a[worker] * (np.asarray(x, np.float64) - self.b[worker])
        if self.noise > 0:
            g = g + self.noise * rng.standard_normal(self.dim)
        return g, self.local_loss(x, worker)

    def fixed_point(self, gammas: Sequence[float]) -> float:
        """Where a method whose aggregate per-cycle stepsizes are Γ_i converges (small α)."""
        g = np.asarray(gammas, np.float64)
        return float(np.sum(g * self.a * self.b) / np.sum(g * self.a))

    def evaluate(self, x: np.ndarray) -> dict[str, Any]:
        x = np.asarray(x, np.float64)
        locs = [self.local_loss(x, i) for i in range(self.num_workers)]
        loss = float(np.dot(self.weights, locs))
        best = float(sum(w * self.local_loss(np.full(self.dim, self.minimizer), i)
                         for i, w in enumerate(self.weights)))
        return {
            "loss": loss,
            "loss_gap": loss - best,
            "dist": float(np.linalg.norm(x - self.minimizer)),
            "client_losses": locs,
        }


class MnistTask:
    name = "mnist"
    layers = ((784, 128), (128, 10))

    def __init__(
        self,
        num_partitions: int = 10,
        dirichlet_alpha: float = 0.0,
        seed: int = 0,
        data_dir: str | None = None,
        batch_size: int = 64,
        weights: Sequence[float] | None = None,
    ) -> None:
        self.num_partitions = int(num_partitions)
        self.alpha = float(dirichlet_alpha)
        self.seed = int(seed)
        self.data_dir = data_dir or None
        self.batch_size = int(batch_size)
        self.weights = None if weights is None else np.asarray(weights, np.float64)
        self._parts: list[tuple[Any, Any]] | None = None
        self._test: tuple[Any, Any] | None = None
        self._lock = threading.Lock()
        self.source = ""

    @property
    def num_workers(self) -> int:
        return self.num_partitions

    @property
    def size(self) -> int:
        return sum(i * o + o for i, o in self.layers)

    # -- data
    def _load(self) -> None:
        with self._lock:
            if self._parts is not None:
                return
            import torch

            from .data import load_mnist, normalize, partition_labels

            data = load_mnist(self.data_dir)
            self.source = data.source
            idx = partition_labels(data.train_y, self.num_partitions, self.alpha, self.seed)
            self._parts = [
                (torch.from_numpy(normalize(data.train_x[i])), torch.from_numpy(data.train_y[i]))
                for i in idx
            ]
            self._test = (torch.from_numpy(normalize(data.test_x)), torch.from_numpy(data.test_y))

    def partition(self, worker: int):
        self._load()
        assert self._parts is not None
        return self._parts[worker]

    def partition_sizes(self) -> list[int]:
        self._load()
        assert self._parts is not None
        return [int(y.shape[0]) for _, y in self._parts]

    # -- model
    def initial_params(self, seed: int = 0, x0: float = 0.0) -> np.ndarray:
        """PyTorch's default ``nn.Linear`` initialisation (U(±1/√fan_in)), from a seeded numpy rng."""
        del x0
        rng = np.random.default_rng((int(seed), 0x1417))
        parts = []
        for fan_in, fan_out in self.layers:
            bound = 1.0 / math.sqrt(fan_in)
            parts.append(rng.uniform(-bound, bound, size=fan_in * fan_out))
            parts.append(rng.uniform(-bound, bound, size=fan_out))
        return np.concatenate(parts).astype(np.float32)

    @staticmethod
    def _views(w):
        W1 = w[:100352].view(128, 784)
        b1 = w[100352:100480]
        W2 = w[100480:101760].view(10, 128)
        b2 = w[101760:101770]
        return W1, b1, W2, b2

    def gradient(
        self,
        x: np.ndarray,
        worker: int,
        rng: np.random.Generator,
        batch_size: int | None = None,
        out: np.ndarray | None = None,
    ):
        """Minibatch gradient of worker ``worker``'s cross-entropy at ``x`` (and the batch loss).

        ``out``: optional float32 buffer of ``size`` elements to write the gradient into (the
        returned array is then ``out`` itself, overwritten by the next call that passes it).
        """
        import torch

        xb, yb = self.minibatch(worker, rng, batch_size)
        if type(x) is not np.ndarray or x.dtype != np.float32:
            x = np.asarray(x, dtype=np.float32)
        return mlp_gradient(torch.from_numpy(x), xb, yb, out)

    def minibatch(self, worker: int, rng: np.random.Generator, batch_size: int | None = None):
        """One job's minibatch of worker ``worker``'s data: (images, labels) tensors."""
        import torch

        X, Y = self._parts[worker] if self._parts is not None else self.partition(worker)
        n = int(Y.shape[0])
        bs = min(int(batch_size or self.batch_size), n)
        idx = torch.from_numpy(rng.choice(n, bs, replace=False))
        # index_select: the same rows as X[idx], without advanced indexing's overhead.
        return X.index_select(0, idx), Y.index_select(0, idx)

    def evaluate(self, x: np.ndarray) -> dict[str, Any]:
        """Mean cross-entropy over the union of the clients' data, per-client losses, test accuracy."""
        import torch

        self._load()
        assert self._parts is not None and self._test is not None
        w = torch.from_numpy(np.asarray(x, dtype=np.float32))
        W1, b1, W2, b2 = self._views(w)
        client_losses = []
        with torch.no_grad():
            for Xc, Yc in self._parts:
                out = torch.addmm(b2, torch.relu(torch.addmm(b1, Xc, W1.t())), W2.t())
                client_losses.append(float(torch.nn.functional.cross_entropy(out, Yc)))
            Xt, Yt = self._test
            out = torch.addmm(b2, torch.relu(torch.addmm(b1, Xt, W1.t())), W2.t())
            acc = float((out.argmax(1) == Yt).float().mean())
        sizes = np.array(self.partition_sizes(), np.float64)
        wts = self.weights if self.weights is not None else sizes / sizes.sum()
        return {"loss": float(np.dot(wts, client_losses)), "accuracy": acc, "client_losses": client_losses}


def mlp_gradient(w, xb, yb, out=None):
    """Hand-written forward/backward of the MLP for one minibatch: (flat gradient, mean loss).

    ``w`` is the flat float32 parameter tensor, ``xb`` a (m, 784) float32 batch, ``yb`` its (m,)
    int64 labels. The gradient is a fresh array, or ``out`` (a float32 numpy array or tensor of
    ``w``'s size) when given.
    Every kernel is chosen to give exactly the bits of the straightforward formulation
    (``p[rows, y] -= 1``, ``dh *= (z > 0)``), only with fewer and cheaper torch calls.
    """
    import torch

    W1, b1, W2, b2 = w.split(_SPLITS)
    W1 = W1.view(128, 784)
    W2 = W2.view(10, 128)
    m = yb.shape[0]
    z = torch.addmm(b1, xb, W1.t())
    h = torch.relu(z)
    p = torch.softmax(torch.addmm(b2, h, W2.t()), dim=1)
    y1 = yb.view(m, 1)
    py = p.gather(1, y1)  # p[rows, y]
    loss = -torch.log(py.clamp_min(1e-30)).mean()
    p.scatter_(1, y1, py.sub_(1.0))  # p[rows, y] -= 1
    p /= m
    if out is None:
        g = torch.empty(w.shape[0], dtype=torch.float32)
    else:
        g = torch.from_numpy(out) if isinstance(out, np.ndarray) else out
        if g.dtype != torch.float32 or g.shape != w.shape or not g.is_contiguous():
            raise ValueError("out must be a contiguous float32 buffer of the model's size")
    gW1, gb1, gW2, gb2 = g.split(_SPLITS)
    torch.mm(p.t(), h, out=gW2.view(10, 128))
    torch.sum(p, 0, out=gb2)
    dh = torch.mm(p, W2)
    dh.mul_(torch.sign(h))  # ReLU mask: sign(relu(z)) is 1.0 where z > 0, else 0.0 (finite z)
    torch.mm(dh.t(), xb, out=gW1.view(128, 784))
    torch.sum(dh, 0, out=gb1)
    return (out if isinstance(out, np.ndarray) else g.numpy()), float(loss)


_SPLITS = (100352, 128, 1280, 10)  # W1 (128×784), b1, W2 (10×128), b2


class ReplicaTask:
    """R replicas of the MNIST task, one model each, for runs that share an event order.

    Replica r has its own seed (data trim, initial model, minibatches); the model is the R
    replicas' flat vectors end to end (R · 101,770 floats), and one job computes every replica's
    minibatch gradient (replicas with the same seed draw the minibatch once). Every gradient and
    every evaluation runs the single run's kernels on the replica's own weights, so each replica
    is its single run bit for bit on any CPU; what batching saves is the event loop, the messages
    and the minibatch draws, not arithmetic. Evaluation returns per-replica lists.
    """

    name = "mnist"

    def __init__(self, tasks: Sequence[MnistTask]) -> None:
        if not tasks:
            raise ValueError("a replica task needs at least one replica")
        self.tasks = list(tasks)
        self.base = self.tasks[0]
        self.replica_seeds = [t.seed for t in self.tasks]
        self.seed = self.base.seed
        self.batch_size = self.base.batch_size
        self.weights = self.base.weights
        self.source = ""

    @property
    def replicas(self) -> int:
        return len(self.tasks)

    @property
    def shared(self) -> bool:
        return len(set(self.replica_seeds)) == 1

    @property
    def num_workers(self) -> int:
        return self.base.num_workers

    @property
    def size(self) -> int:
        return self.replicas * self.base.size

    def initial_params(self, seed: int = 0, x0: float = 0.0) -> np.ndarray:
        del seed
        return np.concatenate([t.initial_params(t.seed, x0) for t in self.tasks])

    def gradient(self, x, worker: int, rng, batch_size: int | None = None, out: np.ndarray | None = None):
        """Every replica's minibatch gradient at its slice of ``x``: (flat gradients, mean loss).

        ``rng``: one generator (shared seed: one minibatch for every replica) or a list with one per
        replica (``job_rng``). Each replica's gradient is the single run's kernel (``mlp_gradient``)
        on that replica's own weights, so every matrix product has the single run's shapes and the
        bits match a single run on any CPU (a stacked product would pick other BLAS kernels, whose
        summation order differs between CPU families).
        """
        import torch

        R = self.replicas
        rngs = rng if isinstance(rng, list) else [rng]
        batches = [t.minibatch(worker, r, batch_size) for t, r in zip(self.tasks, rngs)]
        if len(batches) == 1:
            batches = batches * R
        if out is None or out.shape != (self.size,):
            out = np.empty(self.size, dtype=np.float32)
        P = self.base.size
        weights = np.asarray(x, dtype=np.float32).reshape(R, P)
        rows = out.reshape(R, P)
        # A replica's slice starts 407,080 bytes after the previous one (8-byte aligned only): its
        # weights and gradient go through aligned buffers, as a single run's do.
        w, g = scratch("replica-weights", P), scratch("replica-gradient", P)
        losses = []
        for r, (xb, yb) in enumerate(batches):
            np.copyto(w, weights[r])
            losses.append(mlp_gradient(torch.from_numpy(w), xb, yb, g)[1])
            rows[r] = g
        return out, float(np.mean(losses))

    def evaluate(self, x: np.ndarray) -> dict[str, Any]:
        """Per-replica lists: ``loss`` and ``accuracy`` (R values), ``client_losses`` (R × n, row-major).

        Each replica is scored by its own task's ``evaluate``, so every number equals its single run's.
        """
        R, P = self.replicas, self.base.size
        x = np.asarray(x, dtype=np.float32).reshape(R, P)
        evs = [t.evaluate(x[r].copy()) for r, t in enumerate(self.tasks)]  # (a fresh array, as a single run's)
        self.source = self.base.source
        return {"loss": [e["loss"] for e in evs], "accuracy": [e["accuracy"] for e in evs],
                "client_losses": [v for e in evs for v in e["client_losses"]]}


def local_sgd(task, x: np.ndarray, worker: int, rng: np.random.Generator, steps: int, lr: float,
              prox: float = 0.0) -> tuple[np.ndarray, float]:
    """Q local SGD steps from ``x`` on F_i(y) + (prox/2)‖y − x‖²; returns (Δ = x − y_Q, mean loss).

    Δ is accumulated as Σ_q lr · (g_q + prox · (y_q − x)), which is exactly ``lr · g`` for one
    step, so FedBuff with Q = 1 reproduces a plain ASGD step bit for bit.
    """
    x = np.asarray(x)
    delta = np.zeros(x.shape, dtype=x.dtype)
    y = x
    losses = []
    for _ in range(int(steps)):
        g, loss = task.gradient(y, worker, rng, task.batch_size)
        losses.append(float(loss))
        if prox:
            g = g + prox * (y - x)
        delta += (lr * g).astype(x.dtype, copy=False)
        y = x - delta
    return delta, float(np.mean(losses)) if losses else 0.0


# ---------------------------------------------------------------------------- config and cache
_CACHE: dict[tuple, Any] = {}
_CACHE_LOCK = threading.RLock()  # re-entrant: a replica task builds its replicas through get_task


def _as_list(v: Any) -> list[float] | None:
    if v is None or v == "" or v == []:
        return None
    if isinstance(v, str):
        return [float(s) for s in v.split(",") if s.strip()]
    if isinstance(v, (list, tuple)):
        return [float(s) for s in v]
    return [float(v)]


def task_spec(cfg: dict[str, Any]) -> str:
    """The canonical JSON text of a task's config keys: what every job message carries."""
    return json.dumps({k: cfg[k] for k in TASK_KEYS if k in cfg and cfg[k] is not None}, sort_keys=True)


def build_task(cfg: dict[str, Any] | str):
    """Make a task from its config keys (see ``TASK_KEYS``), given as a dict or ``task_spec`` text.

    ``replica-seeds`` (MNIST only): a ``ReplicaTask`` with one replica per listed seed.
    """
    if isinstance(cfg, str):
        cfg = json.loads(cfg)
    seeds = _as_list(cfg.get("replica-seeds"))
    if seeds:
        if str(cfg.get("task", "mnist")) != "mnist":
            raise ValueError("replicas are supported for the mnist task only")
        base = {k: v for k, v in cfg.items() if k != "replica-seeds"}
        return ReplicaTask([get_task({**base, "seed": int(s)}) for s in seeds])
    task = _build_task(cfg)
    task.seed = int(cfg.get("seed", 0))
    task.batch_size = int(cfg.get("batch-size", 64))
    return task


def _build_task(cfg: dict[str, Any]):
    name = str(cfg.get("task", "mnist"))
    n = int(cfg.get("num-partitions", 10))
    weights = _as_list(cfg.get("weights"))
    if name == "quadratic":
        a = _as_list(cfg.get("quad-a")) or [1.0] * n
        b = _as_list(cfg.get("quad-b")) or [float(i) for i in range(n)]
        if len(a) == 1 and n > 1:
            a = a * n
        return QuadraticTask(a, b, int(cfg.get("quad-dim", 1)), float(cfg.get("noise", 0.0)), weights)
    if name == "mnist":
        return MnistTask(
            n,
            float(cfg.get("dirichlet-alpha", 0.0)),
            int(cfg.get("seed", 0)),
            str(cfg.get("data-dir", "")) or None,
            int(cfg.get("batch-size", 64)),
            weights,
        )
    raise ValueError(f"unknown task {name!r}; choose one of {TASKS}")


def get_task(cfg: dict[str, Any] | str):
    """``build_task`` with a per-process cache keyed by the task's spec text."""
    key = cfg if isinstance(cfg, str) else task_spec(cfg)
    with _CACHE_LOCK:
        task = _CACHE.get(key)
        if task is None:
            task = _CACHE[key] = build_task(cfg)
    return task
