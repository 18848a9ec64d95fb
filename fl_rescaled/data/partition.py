"""Client partitions of a labelled set: one class per client, or Dirichlet label skew, by one of two
schemes (``SCHEMES``).

- ``split`` (the default): each class is split among the clients in Dirichlet(α·1) proportions, and
  every client is then cut to the smallest one's size (``trim``), so that the size-weighted loss the
  MNIST task reports is the equal-weight objective. With strong skew and many clients the smallest
  client is tiny: 100 clients at α = 0.1 keep 2 or 3 MNIST examples each.
- ``mix``: client i draws its own label mix q_i ~ Dirichlet(α·1) over the classes, then ``mix_size``
  examples with class counts Multinomial(size, q_i) (label skew as Hsu, Qi & Brown, 2019, draw it):
  every client the same size whatever α. α → 0 gives one class per client, α → ∞ the uniform mix.
  Within a client the examples are distinct; a class asked for by the clients together more often
  than it occurs is handed out from a reshuffled pass over the same examples, so only then do two
  clients share examples. α = 0 is the one-class partition, as in ``split``.
"""

from __future__ import annotations

import numpy as np

from .mnist import MnistData


def _trim_equal(parts: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """Cut every part to the smallest part's size, keeping a seeded random subset."""
    k = min(len(p) for p in parts)
    out = []
    for p in parts:
        if len(p) > k:
            p = rng.permutation(p)[:k]
        out.append(np.sort(p))
    return out


#: The partition schemes: ``partition_labels(scheme=...)``, the task config's ``partition``, ``--partition``.
SCHEMES = ("split", "mix")


class PartitionError(ValueError):
    """The data cannot be split as asked (too many clients for the examples): a setting that is
    infeasible, refused before the run starts."""


def _one_class_each(by_class: list[np.ndarray], num_clients: int, min_size: int,
                    rng: np.random.Generator) -> list[np.ndarray]:
    """``alpha == 0``: client i gets class i; clients sharing a class split it after a shuffle."""
    C = len(by_class)
    if num_clients <= C:
        parts = [by_class[i] for i in range(num_clients)]
    else:
        parts = [np.empty(0, dtype=np.int64)] * num_clients
        for c in range(C):
            owners = list(range(c, num_clients, C))
            shuffled = rng.permutation(by_class[c])
            for owner, chunk in zip(owners, np.array_split(shuffled, len(owners))):
                parts[owner] = np.sort(chunk)
    sizes = [len(p) for p in parts]
    if min(sizes) < min_size:
        raise PartitionError(f"{num_clients} clients: the alpha=0 partition (one class per client) of "
                             f"{sum(len(c) for c in by_class)} examples leaves a client with {min(sizes)} < "
                             f"{min_size}; use fewer clients (or the quadratic task for a larger population)")
    return parts


def _dirichlet(by_class: list[np.ndarray], num_clients: int, alpha: float, min_size: int,
               rng: np.random.Generator, num_examples: int) -> list[np.ndarray]:
    """``alpha > 0``: per class, proportions ~ Dirichlet(alpha·1), redrawn until every client has
    at least ``min_size`` examples (at most 1000 draws)."""
    for _attempt in range(1000):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            p = rng.dirichlet(np.full(num_clients, alpha))
            shuffled = rng.permutation(idx)
            cuts = (np.cumsum(p)[:-1] * len(shuffled)).astype(np.int64)
            for client, chunk in enumerate(np.split(shuffled, cuts)):
                buckets[client].append(chunk)
        parts = [np.sort(np.concatenate(b)).astype(np.int64) for b in buckets]
        if min(len(p) for p in parts) >= min_size:
            return parts
    raise PartitionError(
        f"no Dirichlet(alpha={alpha}) partition with >= {min_size} examples per client "
        f"after 1000 draws ({num_examples} examples, {num_clients} clients)"
    )


def mix_size(labels: np.ndarray, num_clients: int) -> int:
    """Every client's size under ``mix``: the rarest class's count over ⌈N / number of classes⌉ (what
    one class per client, trimmed, gives when N is a multiple of the number of classes: 542 for 100
    MNIST clients). No client can then ask for more examples of one class than there are."""
    counts = np.unique(np.asarray(labels), return_counts=True)[1]
    return int(counts.min()) // -(-int(num_clients) // counts.size) if counts.size else 0


def _label_mix(by_class: list[np.ndarray], num_clients: int, alpha: float, seed: int, size: int,
               min_size: int) -> list[np.ndarray]:
    """``mix`` with ``alpha > 0``: client i's class counts ~ Multinomial(size, q_i), q_i ~ Dirichlet(α·1)."""
    if size < max(1, min_size):
        raise PartitionError(f"{num_clients} clients: the mix partition gives each {size} < {max(1, min_size)} "
                             f"examples (the rarest class has {min(len(c) for c in by_class)}); use fewer clients")
    rng = np.random.default_rng((int(seed), 0x5EED, 0x1ABE1))
    k = len(by_class)
    counts = np.array([rng.multinomial(size, rng.dirichlet(np.full(k, alpha))) for _ in range(num_clients)])
    if (counts > np.array([len(c) for c in by_class])).any():
        raise PartitionError(f"a client asks for more examples of one class than there are (size {size})")
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, pool in enumerate(by_class):
        demand = int(counts[:, c].sum())
        passes = -(-demand // len(pool)) if demand else 0
        # Consecutive chunks of independent shuffles: a client's chunk never spans two passes' copies
        # of one example, since no client takes more than one pass's worth (checked above).
        stream = np.concatenate([rng.permutation(pool) for _ in range(passes)]) if passes else pool[:0]
        start = 0
        for i in range(num_clients):
            n_i = int(counts[i, c])
            chunk = stream[start:start + n_i]
            if np.unique(chunk).size < n_i:  # the chunk straddles two passes and repeats an example
                chunk = rng.choice(pool, n_i, replace=False)
            parts[i].append(chunk)
            start += n_i
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


def shared_examples(parts: list[np.ndarray]) -> int:
    """How many (client, example) slots hold an example some other client holds too (``mix``)."""
    _, counts = np.unique(np.concatenate(parts), return_counts=True)
    return int(counts[counts > 1].sum())


def partition_labels(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int,
    *,
    trim: bool = True,
    min_size: int = 1,
    scheme: str = "split",
) -> list[np.ndarray]:
    """Split example indices among ``num_clients`` by label.

    ``alpha == 0``: one class per client (client ``i`` gets class ``i`` of the
    sorted class list; with more clients than classes, the clients sharing
    class ``i % C`` split it into equal contiguous chunks after a seeded
    shuffle).  ``alpha > 0`` with ``scheme="split"``: per class, proportions ~
    Dirichlet(alpha·1), redrawn until every client has at least ``min_size``
    examples; with ``scheme="mix"``: per client, a label mix ~ Dirichlet(alpha·1)
    and ``mix_size`` examples drawn from it (see the module docstring).  With
    ``trim`` (``split``; ``mix`` clients are equal in size anyway) all clients
    are cut to the smallest client's size.  Returns sorted int64 index arrays;
    identical inputs and seed give identical output.  ``PartitionError`` when
    a client would hold fewer than ``min_size`` examples.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown partition scheme {scheme!r}; choose one of {SCHEMES}")
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-d, got shape {labels.shape}")
    if int(num_clients) != num_clients or num_clients < 1:
        raise ValueError(f"num_clients must be a positive integer, got {num_clients}")
    num_clients = int(num_clients)
    alpha = float(alpha)
    if not np.isfinite(alpha) or alpha < 0:
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    if classes.size == 0:
        raise ValueError("labels is empty")
    by_class = [np.flatnonzero(labels == c).astype(np.int64) for c in classes]

    if alpha == 0:
        parts = _one_class_each(by_class, num_clients, min_size, rng)
        trim = trim or scheme == "mix"
    elif scheme == "mix":
        return _label_mix(by_class, num_clients, alpha, seed, mix_size(labels, num_clients), min_size)
    else:
        parts = _dirichlet(by_class, num_clients, alpha, min_size, rng, len(labels))
    if trim:
        parts = _trim_equal(parts, rng)
    return [np.asarray(p, dtype=np.int64) for p in parts]


def partition_mnist(
    data: MnistData, num_clients: int, alpha: float, seed: int, *, scheme: str = "split"
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Partition the training set; returns (uint8 images, int64 labels) per client."""
    parts = partition_labels(data.train_y, num_clients, alpha, seed, scheme=scheme)
    return [(data.train_x[idx], data.train_y[idx]) for idx in parts]
