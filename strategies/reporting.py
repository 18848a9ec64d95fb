"""What a run reports: Flower's ``Result`` with the books, reply metrics averaged per evaluation
window, and federated evaluation on the nodes' ``@app.evaluate``."""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fl_rescaled.errors import client_error_text
from fl_rescaled.messages import EVALUATE_TYPE, reply_metrics

log = logging.getLogger("flwr.fl_rescaled")


@dataclass
class AsyncResult(Result):
    """Flower's ``Result`` plus the run's books.

    ``books``: updates applied, jobs sent, replies accepted, rejected (in all and per reason:
    ``rejected.<reason>``), lost, discarded, jobs still in flight, the final time and wall seconds.
    ``evaluate_metrics_*`` and ``train_metrics_clientapp`` are keyed by evaluation number (0 is
    the start), each record with its ``time`` and ``updates``.
    """

    books: MetricRecord = field(default_factory=MetricRecord)

    def __repr__(self) -> str:
        return super().__repr__() + "\nBooks:\n\t" + ", ".join(f"{k}={v}" for k, v in self.books.items()) + "\n"


class MetricWindow:
    """Weighted means of the numeric metrics of the replies accepted since the last evaluation.

    A reply's weight is its ``weighted_by_key`` metric (``num-examples``) when it has one, else 1;
    the weight key itself is summed, not averaged (as Flower's ``aggregate_metricrecords`` leaves it
    out of the means).
    """

    def __init__(self, weighted_by_key: str) -> None:
        self.key = weighted_by_key
        self.clear()

    def clear(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.replies = 0
        self.weight_total = 0.0

    def add(self, metrics: dict[str, Any]) -> None:
        w = metrics.get(self.key)
        w = float(w) if isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 else 1.0
        self.replies += 1
        self.weight_total += w
        for k, v in metrics.items():
            if k == self.key or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if not math.isfinite(v):
                continue
            self.sums[k] = self.sums.get(k, 0.0) + w * float(v)
            self.weights[k] = self.weights.get(k, 0.0) + w

    def record(self) -> dict[str, float]:
        out = {k: self.sums[k] / self.weights[k] for k in self.sums}
        if self.replies:
            out[self.key] = self.weight_total
        return out


def fmt_metrics(metrics: dict[str, Any] | None) -> str:
    """A metrics dict on one log line (lists, such as per-client losses, left out)."""
    items = [(k, v) for k, v in (metrics or {}).items() if not isinstance(v, (list, tuple))]
    if not items:
        return "-"
    return "{" + ", ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in items) + "}"


class FederatedEvaluation:
    """Sends the global model to a fraction of the nodes' ``@app.evaluate`` and averages their metrics."""

    def __init__(self, grid: Grid, config: ConfigRecord | dict | None, timeout: float, *, fraction: float,
                 weighted_by_key: str, arrayrecord_key: str, configrecord_key: str) -> None:
        self.grid = grid
        self.fraction = fraction
        self.weighted_by_key = weighted_by_key
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.config = dict(config.items()) if config is not None else {}
        self.timeout = timeout
        self.failed_once = False

    def run(self, step: int, arrays: ArrayRecord, nodes: list[int]) -> dict[str, float] | None:
        """Evaluate ``arrays`` on a ``fraction`` of ``nodes`` (the online ones); their metrics, averaged."""
        if self.fraction <= 0 or not nodes:
            return None
        k = max(1, int(round(len(nodes) * self.fraction)))
        chosen = sorted(random.Random(step).sample(nodes, k)) if k < len(nodes) else nodes
        cfg = ConfigRecord({**self.config, "server-round": step})
        msgs = [Message(RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: cfg}), n, EVALUATE_TYPE,
                        ttl=self.timeout) for n in chosen]
        ids = set(self.grid.push_messages(msgs))
        window = MetricWindow(self.weighted_by_key)
        errors: list[str] = []
        deadline = time.monotonic() + self.timeout
        wait = getattr(self.grid, "wait_messages", None)  # an in-process Grid computing ahead
        while ids and time.monotonic() < deadline:
            if wait is not None:
                wait(list(ids), timeout=max(0.0, deadline - time.monotonic()))
            got = list(self.grid.pull_messages(list(ids)))
            for rep in got:
                ids.discard(rep.metadata.reply_to_message_id)
                if rep.has_error():
                    errors.append(client_error_text(rep.error.reason))
                elif rep.has_content():
                    window.add(reply_metrics(rep.content))
            if ids and not got:
                time.sleep(0.01)
        if errors and not self.failed_once:
            self.failed_once = True
            log.warning("federated evaluation: %d of %d nodes failed (%s); set fraction_evaluate=0 if the "
                        "ClientApp has no @app.evaluate", len(errors), len(chosen), errors[0])
        return window.record() if window.replies else None
