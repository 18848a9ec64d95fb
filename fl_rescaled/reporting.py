"""What a run reports: Flower's ``Result`` with the books, reply metrics averaged per evaluation
window, the evaluation points (central and federated evaluation on the nodes' ``@app.evaluate``)."""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    """Flower's ``Result`` for an asynchronous run, plus its bookkeeping, each in its own record.

    Keyed as FedAvg keys its rounds: integers, 0 the start (``evaluate_fn`` only, as FedAvg's
    round 0), then 1, 2, ... one per evaluation point. By default a point comes after every round's
    worth of client trainings (C, FedAvg's clients per round), so key k is where FedAvg's round k
    would be: k × C trainings. With ``eval_every`` the points are every that many time units, with
    ``num_evaluations`` that many over the budget; the run's last point is its end.

    - ``arrays``: the final model, in the layout of ``initial_arrays``;
    - ``train_metrics_clientapp[k]``: the metrics of the replies accepted since point k − 1,
      aggregated as FedAvg aggregates a round's (``train_metrics_aggr_fn``);
    - ``evaluate_metrics_clientapp[k]``: federated evaluation at point k ≥ 1 (``evaluate_metrics_aggr_fn``);
    - ``evaluate_metrics_serverapp[k]``: what ``evaluate_fn`` returned at point k;
    - ``progress[k]``: where point k is: ``time`` (virtual time units in process, seconds /
      ``time_unit`` on the wall clock), ``trainings`` (client trainings so far,
      ``Books.trainings``), ``updates`` (server updates so far), ``replies`` (accepted since point
      k − 1), ``cumulative-stepsize``;
    - ``books``: the run's books (``fl_rescaled.manager.books``): updates, trainings, jobs sent,
      replies accepted, rejected and lost (in all and by reason: ``rejected.<reason>``,
      ``lost.<reason>``), discarded, strays, and per worker when there are at most 1,000;
      ``in-flight``: the jobs sent whose replies the run did not wait for (also said in the log;
      ``start(finish_in_flight=True)`` waits for them);
    - ``privacy``: a private run's per-client contributions and ε, their maximum and mean.
    """

    progress: dict[int, MetricRecord] = field(default_factory=dict)
    books: MetricRecord = field(default_factory=MetricRecord)
    #: A private run's ``"dp"`` object (``strategies/dp.py``): per-client contributions and ε; {} otherwise.
    privacy: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return super().__repr__() + "\nBooks:\n\t" + ", ".join(f"{k}={v}" for k, v in self.books.items()
                                                              if not k.endswith("-per-worker")) + "\n"


#: FedAvg's signature for a custom aggregation of reply metrics: (replies' records, weight key) -> record.
AggregateFn = Callable[[list[RecordDict], str], MetricRecord]


#: The most metric names one evaluation window keeps: the replies' further names are dropped (one
#: warning per run), so a client that sends fresh names with every reply cannot grow the window,
#: the history or the checkpoint without bound.
MAX_METRIC_KEYS = 256


@dataclass
class MetricWindow:
    """The metrics of the replies accepted since the last evaluation point, aggregated as Flower's
    FedAvg aggregates a round's (``aggregate_metricrecords``): each key's average over the replies
    that carry it, weighted by their ``weighted_by_key`` metric (``num-examples``; 1 when a reply has
    none), lists element by element; the weight key itself is left out. Non-numbers, non-finite
    values and lists of another length than the window's are dropped, and so are the names beyond
    the window's first ``MAX_METRIC_KEYS``.

    With a custom aggregation (``aggregate``: FedAvg's ``train_metrics_aggr_fn`` signature) the
    window keeps the replies' metrics instead and hands them over as Flower ``RecordDict`` s.
    """

    key: str
    sums: dict[str, Any] = field(default_factory=dict)  # key -> weighted sum (a float, or a list)
    weights: dict[str, float] = field(default_factory=dict)
    replies: int = 0
    kept: list[dict[str, Any]] | None = None  # the replies' metrics (a custom aggregation)
    names: set[str] | None = field(default=None, metadata={"transient": True})  # (kept: the names so far)
    warned: bool = field(default=False, metadata={"transient": True})

    def clear(self) -> None:
        self.sums, self.weights, self.replies, self.names = {}, {}, 0, None
        if self.kept is not None:
            self.kept = []

    def _bounded(self, metrics: dict[str, Any], names: Any) -> dict[str, Any]:
        """``metrics`` without the names that would take the window past ``MAX_METRIC_KEYS``."""
        new = [k for k in metrics if k not in names and k != self.key]
        room = MAX_METRIC_KEYS - len(names)
        if len(new) <= room:
            return metrics
        if not self.warned:
            self.warned = True
            log.warning("a reply's metrics would take the window past %d names: %d names dropped (and any "
                        "further ones, without another warning)", MAX_METRIC_KEYS, len(new) - max(room, 0))
        dropped = set(new[max(room, 0):])
        return {k: v for k, v in metrics.items() if k not in dropped}

    def add(self, metrics: dict[str, Any]) -> None:
        self.replies += 1
        if self.kept is not None:
            if self.names is None:
                self.names = {k for m in self.kept for k in m if k != self.key}
            metrics = self._bounded(metrics, self.names)
            self.names.update(k for k in metrics if k != self.key)
            self.kept.append(dict(metrics))
            return
        metrics = self._bounded(metrics, self.sums)
        w = metrics.get(self.key)
        w = float(w) if _number(w) and w > 0 else 1.0
        for k, v in metrics.items():
            if k == self.key:
                continue
            if _number(v):
                if isinstance(self.sums.get(k, 0.0), float):
                    self.sums[k] = self.sums.get(k, 0.0) + w * float(v)
                    self.weights[k] = self.weights.get(k, 0.0) + w
            elif isinstance(v, list) and v and all(_number(e) for e in v):
                old = self.sums.get(k)
                if old is None:
                    self.sums[k] = [w * float(e) for e in v]
                elif isinstance(old, list) and len(old) == len(v):
                    self.sums[k] = [a + w * float(e) for a, e in zip(old, v)]
                else:
                    continue
                self.weights[k] = self.weights.get(k, 0.0) + w

    def record(self, aggregate: AggregateFn | None = None) -> dict[str, Any]:
        """The aggregated metrics (empty when no reply came)."""
        if not self.replies:
            return {}
        if self.kept is not None and aggregate is not None:
            recs = [RecordDict({"metrics": MetricRecord(m)}) for m in self.kept]
            return dict(aggregate(recs, self.key))
        return {k: ([e / self.weights[k] for e in v] if isinstance(v, list) else v / self.weights[k])
                for k, v in self.sums.items()}


_CAPTURE = threading.local()


@contextmanager
def captured_results() -> Iterator[list[AsyncResult]]:
    """The results of the asynchronous runs this thread finishes inside the ``with`` block
    (``run_inprocess`` returns the ServerApp's this way: Flower's ServerApp returns nothing)."""
    saved = getattr(_CAPTURE, "results", None)
    _CAPTURE.results = results = []
    try:
        yield results
    finally:
        _CAPTURE.results = saved


def report_result(result: AsyncResult) -> None:
    """Hand ``result`` to the ``captured_results`` block this thread is in, if any."""
    results = getattr(_CAPTURE, "results", None)
    if results is not None:
        results.append(result)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def fmt_metrics(metrics: dict[str, Any] | None) -> str:
    """A metrics dict on one log line (lists, such as per-client losses, left out)."""
    items = [(k, v) for k, v in (metrics or {}).items() if not isinstance(v, (list, tuple))]
    if not items:
        return "-"
    return "{" + ", ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in items) + "}"


@dataclass
class EvaluationOptions:
    """How the run evaluates and aggregates metrics, as FedAvg does (``AsyncStrategy``'s
    ``fraction_evaluate``, ``min_evaluate_nodes``, ``weighted_by_key``, ``train_metrics_aggr_fn``,
    ``evaluate_metrics_aggr_fn``; documented there)."""

    fraction_evaluate: float = 1.0
    min_evaluate_nodes: int = 2
    weighted_by_key: str = "num-examples"
    train_metrics_aggr_fn: AggregateFn | None = None
    evaluate_metrics_aggr_fn: AggregateFn | None = None


class FederatedEvaluation:
    """Sends the global model to some of the nodes' ``@app.evaluate`` and aggregates their metrics.

    As FedAvg: max(min_nodes, ⌊fraction · online nodes⌋) nodes, at most all of them (drawn
    with the evaluation point's number as seed); none with ``fraction`` 0; their metrics aggregated
    as ``MetricWindow`` does, or by ``aggregate`` (FedAvg's ``evaluate_metrics_aggr_fn``).
    """

    def __init__(self, grid: AsyncGrid, config: ConfigRecord | dict | None, timeout: float, *, fraction: float,
                 min_nodes: int, weighted_by_key: str, arrayrecord_key: str, configrecord_key: str,
                 aggregate: AggregateFn | None = None) -> None:
        self.grid = grid
        self.fraction, self.min_nodes = fraction, min_nodes
        self.weighted_by_key = weighted_by_key
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.aggregate = aggregate
        self.config = dict(config.items()) if config is not None else {}
        self.timeout = timeout
        self.failed_once = False

    def run(self, step: int, arrays: ArrayRecord, nodes: list[int]) -> dict[str, Any] | None:
        """Evaluate ``arrays`` on some of ``nodes`` (the online ones); their metrics, aggregated."""
        if self.fraction <= 0 or not nodes:
            return None
        k = min(len(nodes), max(self.min_nodes, int(len(nodes) * self.fraction), 1))
        chosen = sorted(random.Random(step).sample(nodes, k)) if k < len(nodes) else nodes
        cfg = ConfigRecord({**self.config, "server-round": step})
        msgs = [Message(RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: cfg}), n, EVALUATE_TYPE,
                        ttl=self.timeout) for n in chosen]
        window = MetricWindow(self.weighted_by_key, kept=[] if self.aggregate is not None else None)
        errors: list[str] = []

        def answered(rep: Message) -> None:
            if rep.has_error():
                errors.append(client_error_text(rep.error.reason))
            elif rep.has_content():
                window.add(reply_metrics(rep.content))

        missing = collect_replies(self.grid, self.grid.push_messages(msgs), time.monotonic() + self.timeout,
                                  answered, what=f"federated evaluation replies (point {step})",
                                  at_deadline=f"given up at the timeout ({self.timeout:g} s)")
        if missing:
            log.warning("federated evaluation: %d of %d nodes did not answer within the timeout (%g s)",
                        len(missing), len(chosen), self.timeout)
        if errors and not self.failed_once:
            self.failed_once = True
            log.warning("federated evaluation: %d of %d nodes failed (%s); set fraction_evaluate=0 if the "
                        "ClientApp has no @app.evaluate", len(errors), len(chosen), errors[0])
        return window.record(self.aggregate) if window.replies else None


EvaluateFn = Callable[[int, ArrayRecord], "MetricRecord | None"]
#: ``on_evaluation(step, arrays, metrics)``: ``metrics`` maps "train", "server", "federated" and
#: "progress" to that evaluation point's records (the ones it has).
OnEvaluation = Callable[[int, ArrayRecord, dict[str, MetricRecord]], None]


class Evaluations:
    """A run's evaluation points: the books and the reply metrics at each, the central evaluation
    (on the Grid's pool when it has one, so the event loop goes on meanwhile) and the federated one.

    Points are finished in order (``drain``): their rows enter the history, their metrics the
    result, ``on_evaluation`` sees them (with the model of that point), and the log and progress bar
    show them. Times in the log carry ``unit``.
    """

    def __init__(self, grid: AsyncGrid, evaluate_fn: EvaluateFn | None, fed_eval: FederatedEvaluation, bar: Any,
                 *, train_aggregate: AggregateFn | None = None, on_evaluation: OnEvaluation | None = None,
                 unit: str = "", on_point: Callable[[int, Any, Any, Any], None] | None = None) -> None:
        self.grid, self.evaluate_fn, self.fed_eval, self.bar = grid, evaluate_fn, fed_eval, bar
        self.train_aggregate, self.on_evaluation, self.unit = train_aggregate, on_evaluation, unit
        #: ``on_point(step, server, federated, arrays)`` once a point is finished, before
        #: ``on_evaluation``: the driver's divergence check (it may raise ``RunFailed``)
        self.on_point = on_point
        self.pending: deque[tuple] = deque()  # the points whose central evaluation may still run

    def point(self, state: Any, t: float, books_row: dict[str, Any], arrays: Callable[[], ArrayRecord],
              online_nodes: Callable[[], list[int]], stored_vectors: int, bar_key: str,
              extra: dict[str, Any] | None = None) -> None:
        """One evaluation point at time ``t`` of the run whose state is ``state`` (a ``RunState``);
        ``books_row`` has its books (with ``trainings``); the progress bar shows ``progress[bar_key]``.
        The federated evaluation runs at every point but the start (FedAvg evaluates on the nodes
        after each round, never before the first); ``online_nodes`` is asked only then (a
        population can be large)."""
        step = state.schedule.step
        row: dict[str, Any] = {"time": float(t), **books_row, "stored_vectors": stored_vectors}
        progress = {"time": float(t), "trainings": books_row["trainings"], "updates": books_row["updates"],
                    "replies": state.window.replies, "cumulative-stepsize": books_row["cumulative_stepsize"]}
        if extra:  # (a private run: ε max and mean so far)
            row.update(extra)
            progress.update({k.replace("_", "-"): v for k, v in extra.items()})
        federated = self.fed_eval.fraction > 0 and step > 0
        evaluated = self.evaluate_fn is not None or federated
        record = arrays() if evaluated or self.on_evaluation is not None else None
        server: Any = None
        if self.evaluate_fn is not None:
            server = self.grid.submit(self.evaluate_fn, step, record)
            if server is None:
                server = self.evaluate_fn(step, record)
        train = state.window.record(self.train_aggregate)
        if train:
            row["train_metrics"] = train
            state.train_metrics[step] = train
        fed = None
        if federated:
            fed = self.fed_eval.run(step, record, online_nodes())
        if fed is not None:
            row["evaluate_metrics"] = fed
            state.client_metrics[step] = fed
        state.progress[step] = progress
        state.history.append(row)
        self.pending.append((step, row, progress, train, fed, server, bar_key, record))
        state.window.clear()
        state.schedule.advance(books_row["updates"], books_row["trainings"])
        self.drain(state, block=False)

    def drain(self, state: Any, block: bool) -> None:
        """Finish the evaluation points whose central evaluation is done, in order (all: ``block``)."""
        while self.pending:
            step, row, progress, train, fed, server, bar_key, record = self.pending[0]
            if isinstance(server, Future):
                if not (block or server.done()):
                    return
                server = server.result()
            self.pending.popleft()
            if server is not None:
                row.update(dict(server))
                state.server_metrics[step] = dict(server)
            log.info("[t=%g%s | %d updates] train: %s%s%s", progress["time"], self.unit, progress["updates"],
                     fmt_metrics(train), f" | server eval: {fmt_metrics(dict(server))}" if server is not None else "",
                     f" | federated eval: {fmt_metrics(fed)}" if fed is not None else "")
            if self.on_point is not None:
                self.on_point(step, server, fed, record)
            if self.on_evaluation is not None:
                metrics = {name: MetricRecord(m) for name, m in (("train", train), ("server", server),
                                                                 ("federated", fed), ("progress", progress)) if m}
                self.on_evaluation(step, record, metrics)
            self.bar.update(progress[bar_key], row)


def log_start(strategy: str, layout: Any, time_budget: float | None, max_updates: int | None,
              max_trainings: int | None = None, rounds: int | None = None) -> None:
    """The start of a run in the log, as FedAvg's (its strategy's own lines follow: ``summary``)."""
    log.info("Starting %s strategy:", strategy)
    log.info("\t├── Model: %d arrays, %d trained values (%s)", len(layout.entries), layout.flat_size,
             layout.flat_dtype)
    log.info("\t├── Budget: %s", " and ".join(([f"{time_budget:g} time units"] if time_budget is not None else [])
                                              + ([f"{max_updates} updates"] if max_updates is not None else [])
                                              + ([f"{max_trainings} client trainings"] if max_trainings is not None
                                                 else [])
                                              + ([("1 round's" if rounds == 1 else f"{rounds} rounds'")
                                                  + " worth of client trainings (FedAvg's work)"]
                                                 if rounds is not None else [])))


def log_end(result: Result, wall_seconds: float) -> None:
    """The end of a run in the log, as FedAvg's: its time and the ``Result``."""
    log.info("")
    log.info("Strategy execution finished in %.2fs", wall_seconds)
    log.info("")
    log.info("Final results:")
    log.info("")
    for line in str(result).splitlines():
        log.info("\t%s", line.strip("\n"))
    log.info("")


def all_rejected(books: Any) -> list[tuple[int, int, dict[str, int]]]:
    """The workers that had replies rejected and none used: (worker, rejected replies, their count by
    reason)."""
    used = books.count("applied") + books.count("unused")
    rejected = books.count("rejected")
    return [(int(w), int(rejected[w]), {key.split(".", 1)[1]: int(c[w]) for key, c in sorted(books.outcomes.items())
                                        if key.startswith("rejected.") and c[w]})
            for w in (used == 0).nonzero()[0] if rejected[w]]


def rejected_lines(found: list[tuple[int, int, dict[str, int]]], name: Callable[[int], str],
                   limit: int = 10) -> list[str]:
    """One line per worker of ``all_rejected`` (the first ``limit``, then how many more)."""
    lines = [f"{name(w)}: all {count} of its replies were rejected ("
             + ", ".join(f"{reason}: {k}" for reason, k in reasons.items()) + ")" for w, count, reasons in found[:limit]]
    return lines + [f"... and {len(found) - limit} more clients whose replies were all rejected"] * (len(found) > limit)


def no_update(books: Any) -> str:
    """Why a run that ended made no update, from its books."""
    cols = books.per_worker()
    rejected, lost, in_flight = (int(cols[k].sum()) for k in ("rejected", "lost", "in-flight"))
    why = (f"it applied no update within its budget ({books.accepted} replies accepted, {rejected} rejected, "
           f"{lost} lost, {in_flight} jobs still in flight)")
    if books.accepted + rejected + lost == 0 and in_flight:  # (what to do: no reply came in time at all)
        why += ("; no reply arrived within the budget: give a larger time_budget (on Flower's runtimes it "
                "counts from start(), the nodes' start-up included) or a num_trainings budget")
    return why
