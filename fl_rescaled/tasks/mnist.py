"""The paper's MNIST task: the MLP 784 → 128 (ReLU) → 10 with cross-entropy, one minibatch per gradient.

The model is one flat float32 vector [W1, b1, W2, b2] (row-major, PyTorch's ``nn.Linear`` layout);
its gradient is computed by hand with torch kernels, which is checked against autograd in the tests.
torch is imported where it is used, so a quadratic-only ClientApp process never loads it.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..data import PARTITION_SCHEMES, load_mnist, normalize, partition_labels
from ..settings import available_cores, cpu_info, yes_or_no
from .base import huge_empty

# Received models are read-only views of the message bytes; the gradient code never writes them.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


class MnistTask:
    """The paper's MNIST task: an MLP (784→128→10), its partitions, its gradients and evaluation."""

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
        *,
        partition: str = "split",
    ) -> None:
        """``partition``: how the training set is split among the clients, ``split`` or ``mix``
        (``fl_rescaled.data.partition``: with ``mix`` every client has the same size whatever α)."""
        self.num_partitions = int(num_partitions)
        self.alpha = float(dirichlet_alpha)
        if partition not in PARTITION_SCHEMES:
            raise ValueError(f"unknown partition {partition!r}; choose one of {PARTITION_SCHEMES}")
        self.partition_scheme = partition
        self.seed = int(seed)
        self.data_dir = data_dir or None
        self.batch_size = int(batch_size)
        self.weights = None if weights is None else np.asarray(weights, np.float64)
        self._parts: list[tuple[Any, Any]] | None = None
        self._images: Any = None
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
    def prepare(self) -> None:
        """Load the data now (else the first job or evaluation does); DataUnavailable if none."""
        self._load()

    def _load(self) -> None:
        with self._lock:
            if self._parts is not None:
                return
            try:
                import torch
            except ModuleNotFoundError as exc:
                raise ModuleNotFoundError("the MNIST task needs torch: pip install 'fl-rescaled[mnist]'") from exc

            data = load_mnist(self.data_dir)
            self.source = data.source
            idx = partition_labels(data.train_y, self.num_partitions, self.alpha, self.seed,
                                   scheme=self.partition_scheme)
            # The partitions' images end to end in one buffer (``images``), each partition a view of it.
            images = huge_empty((sum(len(i) for i in idx), data.train_x.shape[1]), np.float32)
            parts, row = [], 0
            for i in idx:
                images[row:row + len(i)] = normalize(data.train_x[i])
                parts.append((torch.from_numpy(images[row:row + len(i)]), torch.from_numpy(data.train_y[i])))
                row += len(i)
            self._images = torch.from_numpy(images)
            self._parts = parts
            self._test = (torch.from_numpy(normalize(data.test_x)), torch.from_numpy(data.test_y))

    def partition(self, worker: int):
        self._load()
        assert self._parts is not None
        return self._parts[worker]

    def images(self):
        """Every partition's images, in partition order, end to end: one tensor of which each
        partition's images are a view (in memory advised for huge pages: ``tasks.base.huge_empty``)."""
        self._load()
        if self._images is None:  # (partitions given some other way, as tests do: laid end to end once)
            import torch

            assert self._parts is not None
            self._images = torch.cat([x for x, _ in self._parts])
        return self._images

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

        def logits(X):
            with torch.no_grad():  # (a thread's own mode: set in each)
                return torch.addmm(b2, linear(X, W1, b1, relu=True), W2.t())

        def loss(X, Y) -> float:
            return float(torch.nn.functional.cross_entropy(logits(X), Y))

        def accuracy(X, Y) -> float:
            return float((logits(X).argmax(1) == Y).float().mean())

        *client_losses, acc = side_by_side([(loss, *part) for part in self._parts] + [(accuracy, *self._test)])
        sizes = np.array(self.partition_sizes(), np.float64)
        wts = self.weights if self.weights is not None else sizes / sizes.sum()
        return {"loss": float(np.dot(wts, client_losses)), "accuracy": acc, "client_losses": client_losses,
                "worst_client_loss": max(client_losses)}


def mlp_gradient(w, xb, yb, out=None):
    """Hand-written forward/backward of the MLP for one minibatch: (flat gradient, mean loss).

    ``w`` is the flat float32 parameter tensor, ``xb`` a (m, 784) float32 batch, ``yb`` its (m,)
    int64 labels. The gradient is a fresh array, or ``out`` (a float32 numpy array or tensor of
    ``w``'s size) when given, which may be ``w`` itself (every read of the model comes first).
    Every kernel is chosen to give exactly the bits of the straightforward formulation
    (``p[rows, y] -= 1``, ``dh *= (z > 0)``), only with fewer and cheaper torch calls.
    """
    import torch

    W1, b1, W2, b2 = w.split(_SPLITS)
    W1 = W1.view(128, 784)
    W2 = W2.view(10, 128)
    m = yb.shape[0]
    h = linear(xb, W1, b1, relu=True)
    p = torch.softmax(torch.addmm(b2, h, W2.t()), dim=1)
    y1 = yb.view(m, 1)
    py = p.gather(1, y1)  # p[rows, y]
    loss = -torch.log(py.clamp_min(1e-30)).mean()
    p.scatter_(1, y1, py.sub_(1.0))  # p[rows, y] -= 1
    p /= m
    dh = torch.mm(p, W2)  # (the model's last read: ``out`` may be ``w``)
    if out is None:
        g = torch.empty(w.shape[0], dtype=torch.float32)
    else:
        g = torch.from_numpy(out) if isinstance(out, np.ndarray) else out
        if g.dtype != torch.float32 or g.shape != w.shape or not g.is_contiguous():
            raise ValueError("out must be a contiguous float32 buffer of the model's size")
    gW1, gb1, gW2, gb2 = g.split(_SPLITS)
    gW2.view(10, 128).copy_(torch.mm(p.t(), h))  # (MKL's bits depend on where ``out`` lies: a fresh product)
    torch.sum(p, 0, out=gb2)
    dh.mul_(torch.sign(h))  # ReLU mask: sign(relu(z)) is 1.0 where z > 0, else 0.0 (finite z)
    linear(dh.t(), xb.t(), out=gW1.view(128, 784))
    torch.sum(dh, 0, out=gb1)
    return (out if isinstance(out, np.ndarray) else g.numpy()), float(loss)


def onednn() -> bool:
    """Whether ``linear`` runs torch's oneDNN inner product on the CPU (decided once per process).

    ``FL_RESCALED_ONEDNN=1`` asks for it and ``0`` for torch's BLAS; unset, it is chosen on the CPUs
    where we measured it faster (``ONEDNN_CPUS``), torch's BLAS elsewhere. Either way oneDNN only where
    ``onednn_available()``. The choice reads no clock: the same machine, the same kernel and bits.
    """
    global _ONEDNN
    if _ONEDNN is None:
        said = yes_or_no(os.environ.get("FL_RESCALED_ONEDNN", "").strip())
        _ONEDNN = said is not False and onednn_available() and (said or _cpu_family() in ONEDNN_CPUS)
    return _ONEDNN


#: (vendor, CPU family) where the oneDNN inner product is the default: AMD's family 26 (Zen 5), where
#: the MLP's two large products took 70 µs each against 122 with MKL (which runs its AVX2 kernels on
#: AMD). On family 25 (Zen 4) both took 137-146 µs and the gradient 504 µs with oneDNN against 425
#: (its result is copied into the gradient); other CPUs are unmeasured (``docs/performance-log.md``,
#: eighth and tenth rounds).
ONEDNN_CPUS = frozenset({("AuthenticAMD", 26)})


def _cpu_family(path: str = "/proc/cpuinfo") -> tuple[str, int] | None:
    """(vendor, family) of this machine's first CPU (``settings.cpu_info``); None where it cannot be read."""
    info = cpu_info(path)
    if "vendor_id" not in info or "cpu family" not in info:
        return None
    family = info["cpu family"]
    return info["vendor_id"], int(family) if family.isdigit() else -1


def kernel_name() -> str:
    """The kernel of the MLP's large products in this process, as the studies' machine rows name it."""
    return "oneDNN" if onednn() else "torch's BLAS"


def onednn_available() -> bool:
    """Whether this torch has the oneDNN inner product (``torch.ops.mkldnn._linear_pointwise``, the op
    torch.compile's CPU fusions call) and it agrees with ``torch.mm`` on a probe (decided once)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        import torch

        try:
            a = torch.linspace(-1.0, 1.0, 24).view(4, 6)
            b = torch.linspace(2.0, -1.0, 18).view(3, 6)
            got = torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
            _AVAILABLE = bool(torch.allclose(got, a @ b.t(), rtol=1e-5, atol=1e-6))
        except Exception:  # noqa: BLE001 (no such op, another signature, no kernel: torch.mm then)
            _AVAILABLE = False
    return _AVAILABLE


_ONEDNN: bool | None = None
_AVAILABLE: bool | None = None
_THREAD = threading.local()  # the torch thread count each thread last gave OpenMP (``linear``)


def linear(x, w, b=None, *, relu: bool = False, out=None):
    """``x @ w.T`` (+ ``b``, then ReLU when ``relu``), into ``out`` when given: oneDNN's inner
    product for CPU tensors where ``onednn()``, else torch's ``addmm``/``mm``. oneDNN's bits do not
    depend on where the inputs or ``out`` lie (tested); MKL's may depend on ``out``'s alignment, which
    is why the worker's slots start on 64-byte boundaries."""
    import torch

    if x.device.type == "cpu" and onednn():
        threads = torch.get_num_threads()
        if getattr(_THREAD, "threads", None) != threads:  # OpenMP's team size is the calling thread's:
            torch.set_num_threads(threads)  # a thread that never set it would run oneDNN on every core
            _THREAD.threads = threads  # (MKL follows torch's setting in any thread; oneDNN does not)
        y = torch.ops.mkldnn._linear_pointwise(x, w, b, "relu" if relu else "none", [], "")
        return y if out is None else out.copy_(y)
    y = torch.mm(x, w.t(), out=out) if b is None else torch.addmm(b, x, w.t(), out=out)
    return y.relu_() if relu else y


def side_by_side(calls: list[tuple]) -> list:
    """``[f(*args) for f, *args in calls]``, the calls spread over this process's cores when torch
    computes each op on the calling thread (``torch.get_num_threads() == 1``, as in every run of the
    project): each call then runs the same one-thread kernels on whichever thread, so the results are
    the same bits as one after another, sooner (an evaluation's partitions: 1.6× on two cores). With
    more torch threads, one after another (torch's own threads already take the cores)."""
    import torch

    n = min(available_cores(), len(calls), 8) if torch.get_num_threads() == 1 else 1
    if n <= 1:
        return [f(*args) for f, *args in calls]
    with ThreadPoolExecutor(n, thread_name_prefix="fl-rescaled-eval") as pool:  # (per call: nothing left to fork)
        return list(pool.map(lambda call: call[0](*call[1:]), calls))


_SPLITS = (100352, 128, 1280, 10)  # W1 (128×784), b1, W2 (10×128), b2
