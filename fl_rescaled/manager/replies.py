"""What a validated reply means as an update: the direction g the server steps against.

A ``gradient`` reply's arrays are g itself; a ``model`` reply's are the model y its client trained
from the model the job carried, x_sent, and g is the pseudo-gradient x_sent − y. Either way the
arrays are checked against the model's layout first (``fl_rescaled.layout.read_reply``: keys,
shapes, dtypes, finite values), and a reply that does not pass raises ``RejectedReply``. A batch
of replicas (the model is R replicas end to end) keeps its finite replicas: the others are zeroed
and named in the metrics (``nonfinite-replicas``), so that only they are frozen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import Message

from fl_rescaled.errors import RejectedReply
from fl_rescaled.layout import ModelLayout, all_finite, read_reply

from .jobs import zero_nonfinite_replicas


def update_of(reply: Message, layout: ModelLayout, kind: str, sent: Callable[[], np.ndarray], *,
              arrayrecord_key: str, replicas: int = 1) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, Any]]:
    """(g, the reply's non-float arrays, its metrics) of a reply of ``kind`` ("gradient" or "model";
    ``sent``: the flat model its job carried); raises ``RejectedReply``."""
    batched = replicas > 1
    flat, carried, metrics = read_reply(reply, layout, arrayrecord_key=arrayrecord_key,
                                         carried_required=kind == "model", check_finite=not batched)
    if kind == "model":
        with np.errstate(over="ignore", invalid="ignore"):
            flat = np.subtract(sent(), flat)
        if not batched and not all_finite(flat):
            raise RejectedReply("non-finite", "the returned model minus the model sent overflows")
    if batched:
        flat, bad = zero_nonfinite_replicas(flat, replicas)
        if bad:
            metrics["nonfinite-replicas"] = bad
    return flat, carried, metrics
