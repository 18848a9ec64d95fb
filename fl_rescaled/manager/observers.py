"""The manager's observer hook: what benchmarks and metrics watch without patching the manager."""

from __future__ import annotations

from .jobs import Completion, Job


class ManagerObserver:
    """Override the events you need; every method is called synchronously, in event order.

    Register with ``manager.observers.append(observer)`` (or ``start(..., observers=[...])``).
    """

    def job_sent(self, job: Job) -> None:
        """A job was pushed to its node."""

    def reply_awaited(self, job: Job, seconds: float) -> None:
        """Virtual clock: the manager waited ``seconds`` of wall time for ``job``'s reply."""

    def completed(self, comp: Completion) -> None:
        """A job finished: accepted (``comp.ok``) or rejected, before the strategy sees it."""

    def update_applied(self, worker: int, stepsize: float, version: int) -> None:
        """The strategy applied a server update (now ``version``) triggered by ``worker``."""
