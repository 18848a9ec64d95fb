"""A manager read back from a checkpoint: reattached to a Grid, and its jobs in flight sent again
(virtual clock) or booked as lost (wall clock). See ``fl_rescaled.strategies.resume``."""

from __future__ import annotations

from flwr.app import Message
from flwr.serverapp import Grid

from fl_rescaled.messages import JOB_TYPE, job_content

from .manager import AsyncClientManager
from .observers import ManagerObserver


def attach(manager: AsyncClientManager, grid: Grid, observers: list[ManagerObserver] | None = None) -> None:
    """After a checkpoint was read: talk to ``grid`` (and tell ``observers``)."""
    manager.grid = manager.transport.grid = manager.membership.grid = grid
    manager.transport.on_hello = manager.membership.hello_answered
    manager.membership.on_online = manager.worker_online
    manager.observers = list(observers or [])


def resend_inflight(manager: AsyncClientManager) -> None:
    """Virtual clock, after a checkpoint was read: push the jobs that were in flight again, with
    the same model, config and finishing time, so their replies are the ones they would have been."""
    jobs = list(manager.inflight.values())
    manager.inflight.clear()
    for book in manager.books:
        book.pending.clear()
    for job in jobs:
        msg = Message(job_content(job.model, job.config, manager.arrayrecord_key, manager.configrecord_key),
                      job.node_id, JOB_TYPE, ttl=manager.ttl, group_id=str(job.version))
        manager.transport.push(msg, job)
    if manager.scheduler is not None:
        manager.scheduler.rebuild(jobs)


def lose_inflight(manager: AsyncClientManager, reason: str) -> int:
    """Wall clock, after a checkpoint was read: the jobs that were in flight are lost (the nodes
    may have answered a server that no longer exists); returns how many."""
    jobs = list(manager.inflight.values())
    for job in jobs:
        book = manager.books[job.worker]
        book.lost += 1
        book.rejected += 1
        manager.ledger.record_rejection(reason)
        manager.ledger.finished(job.worker, f"lost.{reason}")
    manager.inflight.clear()
    manager.transport.arrived.clear()
    manager.transport.cancelled.clear()
    for book in manager.books:
        book.pending.clear()
    return len(jobs)
