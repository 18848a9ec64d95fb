"""Who is set aside, and why: clients that keep failing, and clients whose updates stay far above
the others'.

- A client whose last ``SET_ASIDE_AFTER`` jobs all failed (``books.is_strike``: a rejected reply, or
  one lost by the client's fault: its ClientApp raised or crashed, its TTL expired) is set aside
  (``strike_out``): for good on the virtual clock, on the wall clock for ``SET_ASIDE_SECONDS``,
  doubling with each further failure. Rounds then close on the clients that remain.
- A client whose updates, judged by the median clip (``fl_rescaled.peer_bounds``) at least
  ``SUSPECT_AFTER`` times, stay on average (moving geometric means of their ratios to the other
  workers' median, weighted and plain: ``MedianClip.suspicion``, the smaller) more than
  ``SUSPECT_RATIO`` times the others' is set aside for good (``suspect``); until then each of its
  updates is clipped.

Neither sets a client aside when more than half the workers would then be aside or failing: a
majority cannot be told from the honest clients. More than half failing stops the run
(``too_many_failing``, read by the run's failure checks); more than half suspect does not (their
updates stay clipped).

The thresholds, measured (``docs/reliability.md``): honest clients on the paper's MNIST split (one
digit per client, τ from 1 to 16) reached weighted moving ratios of at most 4.6 (Vanilla ASGD) and
2.7 (Rescaled ASGD); a client sending 10 × its honest update sits at 6 to 10, a constant or a pull
toward a far target far above.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fl_rescaled.algorithm import Completion
from fl_rescaled.errors import failure_text

#: A worker whose last this many jobs all failed (``books.is_strike``: rejected, or lost by the
#: client's fault) is set aside (``strike_out``).
SET_ASIDE_AFTER = 3
#: Wall clock: seconds a worker is first set aside for; each further failure in a row doubles it
#: (at most 2^10 times). The virtual clock sets a worker aside for good.
SET_ASIDE_SECONDS = 60.0
#: A worker whose updates, judged by the median clip at least ``SUSPECT_AFTER`` times, stay on
#: average (geometric) more than ``SUSPECT_RATIO`` times the other workers' is set aside.
SUSPECT_AFTER = 20
SUSPECT_RATIO = 8.0


def strike_out(m: Any, worker: int, comp: Completion) -> None:
    """``worker``'s last ``SET_ASIDE_AFTER`` (or more) jobs failed, ``comp`` the last: set it aside
    (``Membership.set_aside``), unless more than half the workers would then be failing; then
    ``too_many_failing`` says which, and the run's failure checks stop the run."""
    strikes = int(m.books.strikes[worker])
    failing = np.flatnonzero((m.books.strikes >= SET_ASIDE_AFTER) | m.membership.aside_mask())
    last = f"{comp.rejected}: {failure_text(comp.rejected, comp.detail, 200)}"
    if not may_be_aside(failing.size, m.num_workers):
        names = ", ".join(m.membership.name(int(i)) for i in failing[:10]) + " ..." * (failing.size > 10)
        m.too_many_failing = (f"{failing.size} of {m.num_workers} clients failed {SET_ASIDE_AFTER} times "
                              f"or more in a row ({names}; {m.membership.name(worker)}'s last: {last}), "
                              "and at most half the workers may be set aside")
        return
    seconds = m.source.aside_seconds(strikes)
    how_long = "for good" if math.isinf(seconds) else \
        f"no jobs for {seconds:g} s unless it comes back on a new node"
    m.membership.set_aside(worker, f"its last {strikes} jobs failed (the last: {last}); {how_long}", seconds)


def backoff_seconds(strikes: int) -> float:
    """How long a failing client of a deployment is set aside: ``SET_ASIDE_SECONDS``, doubled for
    every failure beyond ``SET_ASIDE_AFTER`` (at most 2^10 times)."""
    return SET_ASIDE_SECONDS * 2.0 ** min(strikes - SET_ASIDE_AFTER, 10)


def may_be_aside(count: int, n: int) -> bool:
    """Whether ``count`` of ``n`` workers may be set aside at once: at most half (beyond that the
    run's failure checks stop the run; a majority cannot be told from the honest clients)."""
    return 2 * count <= n


def suspect(m: Any, worker: int) -> None:
    """Set ``worker`` aside (for good) when its updates stay far above the other workers'
    (``SUSPECT_RATIO``, after ``SUSPECT_AFTER`` judged), unless more than half the workers would
    then be aside or failing: a majority cannot be told from the honest clients by norms."""
    judged, ratio = m.bound.suspicion(m.bound_state, worker)
    if judged < SUSPECT_AFTER or ratio <= SUSPECT_RATIO or m.membership.is_aside(worker):
        return
    failing = (m.books.strikes >= SET_ASIDE_AFTER) | m.membership.aside_mask()
    if not may_be_aside(int(failing.sum()) + 1, m.num_workers):
        return
    m.membership.set_aside(worker, f"its updates were {ratio:.3g}× the median of the other workers' (a moving "
                                   f"geometric mean; {judged} judged, each clipped to clip_factor × that median); "
                                   "for good", math.inf)
