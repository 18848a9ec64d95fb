"""The manager's part of a run's state, as data: ``ManagerState`` (what a checkpoint keeps of the
books, the roster, the population, the bounds and the jobs in flight; the clock's source keeps its
own part in it), and ``check_jobs``, the check that spans the parts: the jobs in flight of a
checkpoint fit its books. Each part checks the rest of what it restores itself, when the manager
resumes (``AsyncClientManager.resume``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from flwr.app import ConfigRecord

from fl_rescaled.algorithm import Job
from fl_rescaled.bounds import BoundState

from .books import Books
from .membership import Roster
from .selection import PopulationState
from .virtual import VirtualState
from .wall import WallState


@dataclass
class ManagerState:
    """The manager's part of the run's state (``fl_rescaled.runstate``): the books, the roster, the
    population, the update bounds, the jobs in flight with the models they carry, and the clock's
    source's own part (``virtual`` or ``wall``, the other None)."""

    books: Books
    roster: Roster
    active: list[bool]  # per worker: counted in the τ statistics (online and not set aside)
    next_job_id: int
    population: PopulationState
    jobs: list[Job]  # in flight, in push order
    models: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # version -> the model jobs carry
    bounds: list[BoundState] = field(default_factory=list)  # the update bounds' states
    virtual: VirtualState | None = None
    wall: WallState | None = None


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
        try:
            ConfigRecord(job.config)  # (Flower's own check of the values a job's config may hold)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"job {job.job_id} in flight has a config a ConfigRecord cannot hold "
                             f"({str(exc)[:120]})") from None
        ids.add(job.job_id)
        seqs.add((w, job.seq))
        per_worker[w] += 1
    if (per_worker != books.in_flight).any():
        w = int(np.flatnonzero(per_worker != books.in_flight)[0])
        raise ValueError(f"worker {w} has {per_worker[w]} jobs in flight listed, and its books count "
                         f"{books.in_flight[w]}")
