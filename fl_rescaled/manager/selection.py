"""Who gets the next job: the seam between a strategy that wants work done and the population.

A strategy asks for "a job on the current model" after a completion (``send_next``); the selector
decides which worker runs it. ``SameWorker`` gives it to the worker whose job just finished: the
paper's asynchronous SGD, where every worker is always busy and restarts at once.
"""

from __future__ import annotations

from typing import Protocol


class Selector(Protocol):
    """Chooses the worker of the next job."""

    def next_worker(self, after: int) -> int | None:
        """The worker that runs the next job, ``after`` the job of worker ``after`` ended (None:
        nobody now)."""


class SameWorker:
    """The worker whose job just ended runs the next one (every worker always busy)."""

    @staticmethod
    def next_worker(after: int) -> int | None:
        return after
