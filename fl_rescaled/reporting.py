"""What a run reports: Flower's ``Result`` with the books, reply metrics averaged per evaluation
window, the evaluation points (central and federated evaluation on the nodes' ``@app.evaluate``)."""

from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Result

from .errors import client_error_text
from .grid_api import AsyncGrid, collect_replies
from .messages import EVALUATE_TYPE, reply_metrics

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


@dataclass
class MetricWindow:
    """Weighted means of the numeric metrics of the replies accepted since the last evaluation.

    A reply's weight is its ``weighted_by_key`` metric (``num-examples``) when it has one, else 1;
    the weight key itself is summed, not averaged (as Flower's ``aggregate_metricrecords`` leaves it
    out of the means).
    """

    key: str
    sums: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    replies: int = 0
    weight_total: float = 0.0

    def clear(self) -> None:
        self.sums, self.weights, self.replies, self.weight_total = {}, {}, 0, 0.0

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

    def __init__(self, grid: AsyncGrid, config: ConfigRecord | dict | None, timeout: float, *, fraction: float,
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
        window = MetricWindow(self.weighted_by_key)
        errors: list[str] = []

        def answered(rep: Message) -> None:
            if rep.has_error():
                errors.append(client_error_text(rep.error.reason))
            elif rep.has_content():
                window.add(reply_metrics(rep.content))

        collect_replies(self.grid, self.grid.push_messages(msgs), time.monotonic() + self.timeout, answered)
        if errors and not self.failed_once:
            self.failed_once = True
            log.warning("federated evaluation: %d of %d nodes failed (%s); set fraction_evaluate=0 if the "
                        "ClientApp has no @app.evaluate", len(errors), len(chosen), errors[0])
        return window.record() if window.replies else None


EvaluateFn = Callable[[int, ArrayRecord], "MetricRecord | None"]


class Evaluations:
    """A run's evaluation points: the books and the reply metrics at each, the central evaluation
    (on the Grid's pool when it has one, so the event loop goes on meanwhile) and the federated one.

    Points are finished in order (``drain``): their rows enter the history, their metrics the result,
    and the log and progress bar show them.
    """

    def __init__(self, grid: AsyncGrid, evaluate_fn: EvaluateFn | None, fed_eval: FederatedEvaluation,
                 bar: Any) -> None:
        self.grid, self.evaluate_fn, self.fed_eval, self.bar = grid, evaluate_fn, fed_eval, bar
        self.pending: deque[tuple] = deque()  # (step, row, stamp, train, fed, server) not finished yet

    def point(self, state: Any, t: float, books_row: dict[str, Any], arrays: Callable[[], ArrayRecord],
              online_nodes: list[int], stored_vectors: int, by_time: bool) -> None:
        """One evaluation point at time ``t`` of the run whose state is ``state`` (a ``RunState``)."""
        step = state.schedule.step
        row: dict[str, Any] = {"time": float(t), **books_row, "stored_vectors": stored_vectors}
        stamp = {"time": float(t), "updates": books_row["updates"],
                 "cumulative-stepsize": books_row["cumulative_stepsize"]}
        record = None
        server: Any = None
        if self.evaluate_fn is not None:
            record = arrays()
            server = self.grid.submit(self.evaluate_fn, step, record)
            if server is None:
                server = self.evaluate_fn(step, record)
        train = state.window.record()
        if train:
            row["train_metrics"] = train
            state.train_metrics[step] = {**train, "replies": state.window.replies, "time": stamp["time"],
                                         "updates": stamp["updates"]}
        fed = None
        if self.fed_eval.fraction > 0:
            fed = self.fed_eval.run(step, record or arrays(), online_nodes)
        if fed is not None:
            row["evaluate_metrics"] = fed
            state.client_metrics[step] = {**fed, "time": stamp["time"], "updates": stamp["updates"]}
        state.history.append(row)
        self.pending.append((step, row, stamp, train, fed, server, by_time))
        state.window.clear()
        state.schedule.advance(books_row["updates"])
        self.drain(state, block=False)

    def drain(self, state: Any, block: bool) -> None:
        """Finish the evaluation points whose central evaluation is done, in order (all: ``block``)."""
        while self.pending:
            step, row, stamp, train, fed, server, by_time = self.pending[0]
            if isinstance(server, Future):
                if not (block or server.done()):
                    return
                server = server.result()
            self.pending.popleft()
            if server is not None:
                row.update(dict(server))
                state.server_metrics[step] = {**dict(server), **stamp}
            log.info("[t=%g | %d updates] train: %s%s%s", stamp["time"], stamp["updates"], fmt_metrics(train),
                     f" | server eval: {fmt_metrics(dict(server))}" if server is not None else "",
                     f" | federated eval: {fmt_metrics(fed)}" if fed is not None else "")
            self.bar.update(stamp["time"] if by_time else stamp["updates"], row)
