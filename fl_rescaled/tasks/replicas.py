"""R replicas of the MNIST task in one model, for runs that share an event order (``run_batch``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import client_rng, scratch
from .mnist import MnistTask, mlp_gradient


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

    def prepare(self) -> None:
        """Load every replica's data now; DataUnavailable if there is none."""
        for t in self.tasks:
            t.prepare()

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


def job_rng(task, partition: int, job_seq: int):
    """What ``task.gradient`` takes as its randomness for one job (a list, one per replica, for
    a ``ReplicaTask`` with several seeds)."""
    if isinstance(task, ReplicaTask) and not task.shared:
        return [client_rng(s, partition, job_seq) for s in task.replica_seeds]
    return client_rng(task.seed, partition, job_seq)
