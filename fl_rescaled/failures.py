"""What stops a run that cannot make progress, or whose model is gone.

- ``FailureCheck``, after every completion: every worker answered and no reply could be used,
  ``limit`` replies in a row were rejected, or more than half the clients failed too often in a
  row to be set aside (the manager's ``too_many_failing``);
- ``diverged``: the message of a run whose evaluated loss exploded (``fl_rescaled.divergence``),
  naming the clients whose updates were largest;
- ``freeze``: in a batch of replicas, a replica whose gradient went non-finite stops moving.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .errors import RunFailed, failure_text
from .manager import NODE_GONE, AsyncClientManager, Completion

log = logging.getLogger("flwr.fl_rescaled")


class FailureCheck:
    """Stops a run that cannot make progress: every worker answered and no reply could be used,
    ``limit`` replies in a row were rejected (jobs lost because their node left do not count), or
    more than half the clients failed too often in a row to be set aside (the manager's
    ``too_many_failing``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __call__(self, state: Any, manager: AsyncClientManager, comp: Completion) -> None:
        if comp.ok:
            state.consecutive = 0
            state.answered[comp.worker] = True
        elif comp.rejected not in NODE_GONE:
            state.consecutive += 1
            state.answered[comp.worker] = True
        books = manager.books
        if not comp.ok and state.answered.all() and books.accepted == 0:
            failed = sum(books.failures().values())
            raise RunFailed(self.failure(books, f"no reply could be used: every worker answered and all {failed} "
                                                "replies were rejected"), manager.books_totals())
        if state.consecutive >= self.limit:
            raise RunFailed(self.failure(books, f"{state.consecutive} replies in a row were rejected"),
                            manager.books_totals())
        if manager.too_many_failing:  # (more than half the clients failed m times in a row each)
            raise RunFailed(self.failure(books, manager.too_many_failing), manager.books_totals())

    @staticmethod
    def failure(books: Any, what: str) -> str:
        first = books.first_failure
        if first is None:
            return f"the run cannot make progress: {what}"
        reason, detail = first
        text = failure_text(reason, detail)
        return f"the run cannot make progress: {what}. The first rejection ({reason}): {text}"


def freeze(state: Any, replicas: Sequence[int], t: float) -> None:
    """Batched runs: a replica whose gradient went non-finite has diverged; its model stops moving
    (α_r = 0) while the other replicas go on with the same events."""
    for r in replicas:
        if int(r) not in state.frozen:
            state.frozen[int(r)] = float(t)
            state.replica_lrs[int(r)] = 0.0
            log.warning("replica %d: non-finite gradient at t=%g; replica frozen (diverged)", r, t)


def diverged(why: str, manager: AsyncClientManager, best_step: int, best_loss: float) -> str:
    """The one line of a run whose model diverged: why, the clients whose updates stood furthest
    above the other workers' (``Chain.largest``), and where the best model is."""
    largest = manager.largest_updates(3)
    names = ", ".join(f"{manager.membership.name(w)} ({ratio:.3g}× the median of the others')" for w, ratio in largest)
    best = (f"the best model (evaluation point {best_step}, loss {best_loss:.4g}) is in RunFailed.result"
            if best_step >= 0 else "no evaluation point had a finite loss")
    return (f"the model diverged: {why}. The clients whose updates were largest: {names or 'none judged yet'}; "
            f"{best}. A stepsize too large diverges too: lower it if those clients are not to blame")
