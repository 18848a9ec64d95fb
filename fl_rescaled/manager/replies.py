"""What a validated reply means as an update: the direction g the server steps against.

A ``gradient`` reply's arrays are g itself; a ``model`` reply's are the model y its client trained
from the model the job carried, x_sent, and g is the pseudo-gradient x_sent − y. Either way the
arrays are checked against the model's layout first (``fl_rescaled.layout.read_reply``: keys,
shapes, dtypes), then g's values are tested finite as its norm is taken, in one pass (the bounds
use that norm), and a reply that does not pass raises ``RejectedReply``. A batch
of replicas (the model is R replicas end to end) keeps its finite replicas: the others are zeroed
and named in the metrics (``nonfinite-replicas``), so that only they are frozen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import Message

from fl_rescaled.errors import RejectedReply
from fl_rescaled.bounds import finite_norm
from fl_rescaled.layout import ModelLayout, read_reply

from .jobs import zero_nonfinite_replicas


def update_of(reply: Message, layout: ModelLayout, kind: str, sent: Callable[[], np.ndarray], *,
              arrayrecord_key: str, replicas: int = 1
              ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, Any], float | None]:
    """(g, the reply's non-float arrays, its metrics, ‖g‖₂) of a reply of ``kind`` ("gradient" or
    "model"; ``sent``: the flat model its job carried); raises ``RejectedReply``. The norm comes with
    the finiteness test, in one pass (``bounds.finite_norm``); None for a batch of replicas."""
    batched = replicas > 1
    flat, carried, metrics = read_reply(reply, layout, arrayrecord_key=arrayrecord_key,
                                         carried_required=kind == "model", check_finite=kind == "model" and not batched)
    norm = None
    if kind == "model":
        with np.errstate(over="ignore", invalid="ignore"):
            flat = np.subtract(sent(), flat)
        if not batched:
            norm = finite_norm(flat)
            if norm is None:
                raise RejectedReply("non-finite", "the returned model minus the model sent overflows")
    elif not batched:
        norm = finite_norm(flat)
        if norm is None:  # (read again with the test that names the arrays: it raises)
            read_reply(reply, layout, arrayrecord_key=arrayrecord_key, carried_required=False)
            raise RejectedReply("non-finite", "NaN or infinite values")
    if batched:
        flat, bad = zero_nonfinite_replicas(flat, replicas)
        if bad:
            metrics["nonfinite-replicas"] = bad
    return flat, carried, metrics, norm
