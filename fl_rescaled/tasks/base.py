"""What every task shares: the ``Task`` protocol, the task names and config keys, each job's
random generator, aligned gradient buffers and local SGD."""

from __future__ import annotations

import mmap
import threading
from typing import Any, Protocol, runtime_checkable

import numpy as np

TASKS = ("mnist", "quadratic")


@runtime_checkable
class Task(Protocol):
    """What the ClientApp and the experiment runner need of a learning task."""

    name: str
    seed: int
    batch_size: int

    @property
    def num_workers(self) -> int: ...

    @property
    def size(self) -> int: ...

    def initial_params(self, seed: int = 0, x0: float = 0.0) -> np.ndarray: ...

    def gradient(self, x: np.ndarray, worker: int, rng: Any, batch_size: int | None = None): ...

    def evaluate(self, x: np.ndarray) -> dict[str, Any]: ...


# Config keys that define a task (everything else in a job config is per-job).
TASK_KEYS = (
    "task",
    "seed",
    "num-partitions",
    "batch-size",
    "dirichlet-alpha",
    "partition",
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


def _aligned_view(raw: np.ndarray, nbytes: int, align: int, dtype: np.dtype) -> np.ndarray:
    """``nbytes`` of the byte buffer ``raw`` (``align`` bytes longer than that) from its first
    ``align``-byte boundary on, as a 1-D array of ``dtype``."""
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype)


def aligned_empty(size: int, dtype=np.float32) -> np.ndarray:
    """An uninitialised 1-D array whose data starts on an ``ALIGN``-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = size * dtype.itemsize
    return _aligned_view(np.empty(nbytes + ALIGN, dtype=np.uint8), nbytes, ALIGN, dtype)


#: Bytes of a transparent huge page (x86-64; ``huge_empty``).
HUGE_PAGE = 2 << 20


def huge_empty(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """An uninitialised array in private anonymous memory, ``HUGE_PAGE``-aligned, that the kernel is
    asked to back with transparent huge pages (Linux's ``madvise(MADV_HUGEPAGE)``, honoured where THP
    is ``always`` or ``madvise``); ``np.empty`` where that advice does not exist or is refused, or for
    less than a huge page. For the MNIST images, of which every job gathers 64 random rows: one
    translation a 2 MB page instead of one a 4 KB page (a gather 33 -> 28 µs, a gradient job about
    10 µs less, in a loop on this project's machine)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE:
        return np.empty(shape, dtype)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(advice)
    except (OSError, ValueError, AttributeError):
        return np.empty(shape, dtype)
    raw = np.frombuffer(region, np.uint8)  # (the array keeps the mapping alive)
    return _aligned_view(raw, nbytes, HUGE_PAGE, dtype).reshape(shape)


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
