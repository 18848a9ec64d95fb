"""The study's label-skew partition for α > 0: every client draws its own label mix, all clients the
same size.

Why not the core's. ``fl_rescaled.data.partition_labels`` splits each class over the clients with
Dirichlet(α) proportions and then trims every client to the smallest one's size (so that the
size-weighted loss the MNIST task reports is the equal-weight objective). With 100 clients and
α = 0.1 the smallest client holds 2 or 3 examples, so trimming leaves 200 to 300 training examples
in all (seeds 0–2). Here instead (as Hsu, Qi & Brown, 2019, draw label skew), client i draws its
label mix q_i ~ Dirichlet(α·1) over the 10 digits and then ``size`` examples with class counts
Multinomial(size, q_i); α → 0 gives one class per client, α → ∞ the uniform mix. Within a client
the examples are distinct; a digit asked for by more clients than it has examples is handed out
from a reshuffled pass over the same examples, so only then do two clients share examples.

``install`` puts the partition into the run's task (the per-process cached ``MnistTask`` that the run
and the in-process ClientApp share) before ``experiment.run`` starts; α = 0 keeps the core's partition
(one class per client, 10 clients per digit, each trimmed to 542 examples).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from fl_rescaled.data import load_mnist, normalize, partition_labels
from fl_rescaled.experiment import RunSpec
from fl_rescaled.tasks import get_task


def label_skew_partition(labels: np.ndarray, num_clients: int, alpha: float, seed: int,
                         size: int) -> list[np.ndarray]:
    """``num_clients`` sorted int64 index arrays of ``size`` examples each, client i's labels drawn
    from q_i ~ Dirichlet(α·1) (α > 0). The same inputs give the same partition."""
    labels = np.asarray(labels)
    if not (alpha > 0 and np.isfinite(alpha)):
        raise ValueError(f"alpha must be positive and finite, got {alpha!r}")
    if num_clients < 1 or size < 1:
        raise ValueError("num_clients and size must be positive")
    rng = np.random.default_rng((int(seed), 0x5EED, 0x1ABE1))
    classes = np.unique(labels)
    pools = [np.flatnonzero(labels == c) for c in classes]
    counts = np.array([rng.multinomial(size, rng.dirichlet(np.full(classes.size, alpha)))
                       for _ in range(num_clients)])
    if (counts > np.array([len(p) for p in pools])).any():
        raise ValueError(f"a client asks for more examples of one class than it has (size {size})")
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, pool in enumerate(pools):
        demand = int(counts[:, c].sum())
        passes = -(-demand // len(pool)) if demand else 0
        # Consecutive chunks of independent shuffles: a client's chunk never spans two passes' copies
        # of one example, since no client takes more than one pass's worth (checked above).
        stream = np.concatenate([rng.permutation(pool) for _ in range(passes)]) if passes else pool[:0]
        start = 0
        for i in range(num_clients):
            k = int(counts[i, c])
            chunk = stream[start:start + k]
            if np.unique(chunk).size < k:  # the chunk straddles two passes and repeats an example
                chunk = rng.choice(pool, k, replace=False)
            parts[i].append(chunk)
            start += k
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


def shared_examples(parts: list[np.ndarray]) -> int:
    """How many (client, example) slots hold an example some other client holds too."""
    _, counts = np.unique(np.concatenate(parts), return_counts=True)
    return int(counts[counts > 1].sum())


@lru_cache(maxsize=1)
def _mnist(data_dir: str | None):
    return load_mnist(data_dir)  # (once per process: every run of a worker process reads the same files)


def install(spec: RunSpec, size: int) -> dict[str, Any]:
    """Give the run of ``spec`` (resolved: ``num_clients`` set) the study's partition; returns what it is.

    Works through the task cache of ``fl_rescaled.tasks.get_task``: the task the run will build is
    built here, loaded, and its client data replaced (``MnistTask._parts``). A workaround: the core
    has no partition option for this (see the module's docstring).
    """
    if spec.dirichlet_alpha == 0:
        return {"kind": "one class per client (fl_rescaled.data.partition_labels, trimmed)", "size": size}
    import torch  # heavy: only the processes that run MNIST need it

    task = get_task(spec.task_config())
    task.prepare()
    data = _mnist(spec.data_dir)
    parts = label_skew_partition(data.train_y, spec.num_clients, spec.dirichlet_alpha, spec.seed, size)
    task._parts = [(torch.from_numpy(normalize(data.train_x[i])), torch.from_numpy(data.train_y[i])) for i in parts]
    classes = [int(np.unique(data.train_y[i]).size) for i in parts]
    return {"kind": f"per-client Dirichlet({spec.dirichlet_alpha:g}) label mix, equal sizes", "size": size,
            "classes_per_client_mean": float(np.mean(classes)), "shared_examples": shared_examples(parts),
            "core_trimmed_size": len(partition_labels(data.train_y, spec.num_clients, spec.dirichlet_alpha,
                                                      spec.seed)[0])}
