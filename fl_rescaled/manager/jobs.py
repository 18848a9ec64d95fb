"""What the manager alone knows of jobs: which failures mean a node is gone, a batched reply's
non-finite replicas, and whether a checkpoint's jobs in flight fit its books (``check_jobs``).
(``Job`` and ``Completion``, what a strategy reads, live with the ``Run`` protocol in
``fl_rescaled.algorithm``.)"""

from __future__ import annotations

from typing import Any

import numpy as np

from fl_rescaled.algorithm import Job
from fl_rescaled.layout import all_finite

from .books import Books

#: Failure reasons that mean the node itself is gone (not just this job): Flower's
#: MESSAGE_UNAVAILABLE (expired in transit), NODE_UNAVAILABLE, our own TTL expiry, and a client that
#: went offline (an availability model on the virtual clock).
NODE_GONE = ("error-code-3", "error-code-5", "ttl-expired", "offline")


def zero_nonfinite_replicas(flat: np.ndarray, replicas: int) -> tuple[np.ndarray, list[int]]:
    """A batched reply (R replicas' vectors end to end) with the non-finite replicas' rows zeroed
    (in a copy) and their indices, instead of a rejection for every replica (they are frozen)."""
    if all_finite(flat):
        return flat, []
    rows = flat.reshape(replicas, -1).copy()
    bad = ~np.isfinite(rows).all(axis=1)
    rows[bad] = 0.0
    return rows.reshape(-1), [int(r) for r in np.flatnonzero(bad)]


def _flat_config_value(value: Any) -> bool:
    """A value a Flower ``ConfigRecord`` holds: a scalar, or a list of scalars of one type."""
    if isinstance(value, list):
        return len({type(v) for v in value}) <= 1 and all(isinstance(v, SCALARS) for v in value)
    return isinstance(value, SCALARS)


#: The types of a ConfigRecord's values (and of its lists' items).
SCALARS = (bool, int, float, str, bytes)


def check_jobs(jobs: list[Job], books: Books, next_job_id: int, versions: set[int]) -> None:
    """Raise ValueError unless ``jobs`` (the jobs in flight of a checkpoint) are ones the manager
    could have had in flight with ``books``: unique ids below ``next_job_id``, workers in range,
    model versions not ahead of the model's and among ``versions`` (the models the file keeps),
    each worker's job numbers among those it was sent, as many per worker as the books count, and
    configs a ``ConfigRecord`` can carry."""
    n = books.n
    ids: set[int] = set()
    seqs: set[tuple[int, int]] = set()
    per_worker = np.zeros(n, np.int64)
    for job in jobs:
        w = job.worker
        if not 0 <= w < n:
            raise ValueError(f"job {job.job_id} in flight is for worker {w}, and the run has {n}")
        if not 0 <= job.job_id < next_job_id or job.job_id in ids:
            raise ValueError(f"job id {job.job_id} in flight is listed twice, or was never given out "
                             f"(the next is {next_job_id})")
        if not 0 <= job.seq < books.jobs_sent[w] or (w, job.seq) in seqs:
            raise ValueError(f"job {job.job_id} in flight is worker {w}'s job number {job.seq}, which the "
                             "books never sent or count twice")
        if not 0 <= job.version <= books.version or job.version not in versions:
            raise ValueError(f"job {job.job_id} in flight carries model version {job.version}, which the "
                             "checkpoint does not hold")
        bad = [k for k, v in job.config.items() if not _flat_config_value(v)]
        if bad:
            raise ValueError(f"job {job.job_id} in flight has config {bad[0][:60]!r}, which is not a "
                             "value a ConfigRecord holds")
        ids.add(job.job_id)
        seqs.add((w, job.seq))
        per_worker[w] += 1
    if (per_worker != books.in_flight).any():
        w = int(np.flatnonzero(per_worker != books.in_flight)[0])
        raise ValueError(f"worker {w} has {per_worker[w]} jobs in flight listed, and its books count "
                         f"{books.in_flight[w]}")
