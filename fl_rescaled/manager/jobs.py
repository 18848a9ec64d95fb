"""What the manager alone knows of jobs: which failures mean a node is gone, and a batched reply's
non-finite replicas. (``Job`` and ``Completion``, what a strategy reads, live with the ``Run``
protocol in ``fl_rescaled.algorithm``.)"""

from __future__ import annotations

import numpy as np

from fl_rescaled.layout import all_finite


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
