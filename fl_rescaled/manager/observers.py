"""The observer hook: what benchmarks, metrics and tests watch without patching the manager or driver."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fl_rescaled.algorithm import Completion, Job


class ManagerObserver:
    """Override the events you need; every method is called synchronously, in event order.

    Register with ``start(..., observers=[...])``.
    """

    def job_sent(self, job: Job) -> None:
        """A job was pushed to its node."""

    def reply_awaited(self, job: Job, seconds: float) -> None:
        """Virtual clock: the manager waited ``seconds`` of wall time for ``job``'s reply."""

    def completed(self, comp: Completion) -> None:
        """A job finished: accepted (``comp.ok``) or rejected, before the strategy sees it."""

    def job_cancelled(self, job: Job, t: float | None = None) -> None:
        """The strategy cancelled ``job`` at time ``t`` (its work so far is discarded)."""

    def update_applied(self, worker: int, stepsize: float, version: int) -> None:
        """The strategy applied a server update (now ``version``) triggered by ``worker``."""

    def handled(self, comp: Completion, x: np.ndarray) -> None:
        """The strategy handled ``comp`` (applied, buffered or rejected it); ``x`` is the model now."""


class OnEvent(ManagerObserver):
    """Calls ``fn(comp, x)`` after the strategy handled each completion (``x``: the model then)."""

    def __init__(self, fn: Callable[[Completion, np.ndarray], object]) -> None:
        self.fn = fn

    def handled(self, comp: Completion, x: np.ndarray) -> None:
        self.fn(comp, x)
