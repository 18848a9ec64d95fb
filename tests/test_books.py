"""Books that balance: for every worker, jobs sent = applied + rejected + lost + discarded + in flight,
whatever the method (cancelled rounds, late replies, queues, buffers)."""

from __future__ import annotations

import pytest

from conftest import assert_books_balance, quad, run_of, start_run
from fl_rescaled.strategies import STRATEGIES


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_methods_books_balance_per_worker(strategy):
    out = quad(strategy=strategy, taus=[1, 2, 3, 5], quad_a=[1, 2, 1, 3], quad_b=[0, 2, -1, 4], lr=0.05, budget=80,
               delays="exponential", seed=2, eval_every=10)
    books = out["books"]
    assert_books_balance(books, strategy)
    assert min(books["sent-per-worker"]) > 0
    if strategy in ("rescaled", "vanilla"):  # one update per applied reply
        assert sum(books["applied-per-worker"]) == out["num_updates"]
    if strategy == "malenia":  # cancelled jobs are in the books as discarded
        assert sum(books["discarded-per-worker"]) > 0


def test_unbalanced_books_are_reported_loudly():
    from fl_rescaled.manager.books import Books

    books = Books.sized(2)
    for _ in range(3):
        books.sent(0)
    books.ended(0, "applied")
    books.ended(0, "lost.ttl-expired")
    books.in_flight[0] = 0  # (a bug that forgets a job in flight)
    with pytest.raises(AssertionError, match="worker 0: 3 jobs sent, but 1 applied"):
        books.check_balance()
    books.in_flight[0] = 1
    books.ended(0, "cancelled")
    books.check_balance()
    assert books.balance()[0] == {"sent": 3, "applied": 1, "rejected": 0, "lost": 1, "discarded": 1, "in-flight": 0,
                                  "balanced": 1}


@pytest.mark.parametrize("strategy", ["rescaled", "vanilla", "fedbuff", "malenia"])
def test_rejected_replies_are_booked_as_rejected_and_never_as_applied(strategy):
    """Worker 0's gradients overflow (a_0 = 1e308): each of its replies is rejected as non-finite
    until it is set aside after three; the books say so, per worker, and still balance."""
    out = quad(strategy=strategy, taus=[1, 2, 3], quad_a=[1e308, 1, 1], quad_b=[1, 0, 2], quad_x0=0.0, lr=0.05,
               budget=60, eval_every=60)
    books = out["books"]
    assert_books_balance(books, strategy)
    assert books["rejected-per-worker"][0] == 3 and books["applied-per-worker"][0] == 0, books
    assert books["rejected-per-worker"][1:] == [0, 0] and min(books["applied-per-worker"][1:]) > 0, books
    assert books["rejected"] == 3 and out["rejected"] == {"non-finite": 3}, out["rejected"]


# ================================================================================ bounded books
# Whatever the clients send, the books hold a bounded table: Flower's error codes keep their key,
# the first UNKNOWN_CODES other codes too, the rest are pooled; details and log lines are bounded.
import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict  # noqa: E402

import hostile  # noqa: E402
from fl_rescaled import DelayModel, InProcessGrid, RunFailed, VirtualClock  # noqa: E402
from fl_rescaled.checkpoints import CheckpointError  # noqa: E402
from fl_rescaled.manager.books import DETAIL_LIMIT, MAX_OUTCOMES, OTHER_CODE, UNKNOWN_CODES, Books  # noqa: E402
from fl_rescaled.reporting import MAX_METRIC_KEYS  # noqa: E402
from fl_rescaled.runstate import Checkpointing, load, save  # noqa: E402


class ErrorGrid(InProcessGrid):
    """``hostile``'s four nodes; the nodes in ``bad`` answer every other job with an error reply whose
    code (``code(k)``, the k-th error) and reason (``reason``) the test chooses."""

    def __init__(self, bad=(2,), code=lambda k: 1000 + k, reason="fresh", every=2) -> None:
        super().__init__(hostile.app, hostile.N)
        self.bad, self.code, self.reason, self.every, self.k = {self.node_ids[i] for i in bad}, code, reason, every, 0

    def _execute(self, msg):
        rep = super()._execute(msg)
        if msg.metadata.message_type != "train" or msg.metadata.dst_node_id not in self.bad:
            return rep
        self.k += 1
        if self.k % self.every:
            return rep
        err = Message(Error(code=self.code(self.k), reason=self.reason), reply_to=msg)
        err.metadata.__dict__["_message_id"] = rep.metadata.message_id
        return err


def run_errors(grid, budget=400.0, checkpoint=None):
    s = STRATEGIES["rescaled"](fraction_evaluate=0.0)
    res = start_run(s, grid, ArrayRecord({"w": Array(np.zeros(hostile.DIM, np.float32))}), time_budget=budget,
                  clock=VirtualClock(DelayModel(hostile.TAUS)), train_config={"reply": "gradient"},
                  partition_query=True, checkpoint=checkpoint)
    return s, res


def test_a_fresh_error_code_with_every_other_reply_keeps_the_table_bounded_and_the_checkpoint_readable(tmp_path):
    """Partition 2 answers every other job with a new error code (so it is never set aside): the
    first UNKNOWN_CODES codes keep a key, the ~100 others are pooled; the run is checkpointed and
    resumed, and the resumed run's table is as bounded."""
    plan = Checkpointing(tmp_path / "run.ckpt", 100.0, "flood")
    s, res = run_errors(ErrorGrid(), checkpoint=plan)
    lost = {k: v for k, v in res.books.items() if k.startswith("lost.")}
    assert sorted(lost) == sorted([f"lost.error-code-{1000 + 2 * j}" for j in range(1, UNKNOWN_CODES + 1)]
                                  + [f"lost.{OTHER_CODE}"]), lost
    assert lost[f"lost.{OTHER_CODE}"] > 50 and res.books["lost"] == sum(lost.values())
    assert len(run_of(s).manager.books.outcomes) == UNKNOWN_CODES + 2  # (and "applied")
    assert_books_balance(res.books, "flood")
    resumed, res2 = run_errors(ErrorGrid(), checkpoint=Checkpointing(plan.path, 100.0, "flood", resume=True))
    assert len(run_of(resumed).manager.books.outcomes) == UNKNOWN_CODES + 2
    assert res2.books["updates"] == res.books["updates"]


def test_flowers_own_codes_keep_their_keys_and_junk_codes_are_pooled():
    books = Books.sized(1)
    keys = [books.reason_key(r) for r in ("error-code-2", "error-code-08", "error-code-True", "error-code-2\nx",
                                          "error-code-" + "9" * 40, "error-code-None")]
    assert keys == ["error-code-2", "error-code-8"] + [OTHER_CODE] * 4


def _checkpoint_with(tmp_path, keys):
    """A real run's checkpoint whose books get ``keys`` (each with one count) added; its plan."""
    plan = Checkpointing(tmp_path / "run.ckpt", 100.0, "bound")
    s, _ = run_errors(ErrorGrid(every=10_000), budget=150.0, checkpoint=plan)
    plan = plan.covering(s, run_of(s).layout, 150.0, None)
    state = load(plan, s.State)
    books = state.manager.books
    for key in keys:
        books.outcomes[key] = np.zeros(books.n, np.int64)
        books.outcomes[key][2] = 1
        books.jobs_sent[2] += 1
    save(plan, state)
    return plan


def test_a_checkpoint_with_more_outcome_keys_than_the_bound_is_refused_with_one_line(tmp_path):
    _checkpoint_with(tmp_path, [f"lost.error-code-{1000 + j}" for j in range(MAX_OUTCOMES)])
    with pytest.raises(CheckpointError) as info:
        run_errors(ErrorGrid(), budget=150.0, checkpoint=Checkpointing(tmp_path / "run.ckpt", 100.0, "bound", resume=True))
    msg = str(info.value)
    assert "outcome keys" in msg and f"the {MAX_OUTCOMES}" in msg and "\n" not in msg and len(msg) < 400, msg


def test_an_older_checkpoint_with_many_codes_within_the_bound_resumes_and_pools_new_ones(tmp_path):
    """Written before unknown codes were pooled: ten of them, each with its key. It resumes; every
    new unknown code is then pooled."""
    _checkpoint_with(tmp_path, [f"lost.error-code-{5000 + j}" for j in range(10)])
    s, res = run_errors(ErrorGrid(), budget=150.0, checkpoint=Checkpointing(tmp_path / "run.ckpt", 100.0, "bound",
                                                                           resume=True))
    lost = {k for k in res.books if k.startswith("lost.")}
    assert lost == {f"lost.error-code-{5000 + j}" for j in range(10)} | {f"lost.{OTHER_CODE}"}
    assert_books_balance(res.books, "resumed")


def test_a_huge_error_text_with_line_breaks_stays_one_short_line(caplog):
    """A 10 MB reason with line breaks and terminal escapes, from three clients of four: every log
    line is one line of bounded length, the books keep DETAIL_LIMIT characters, and the run stops
    with a one-line RunFailed."""
    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    reason = "<class 'RuntimeError'>:<'first line\nsecond \x1b[31mred\x1b[0m\r\x00" + "x" * 10_000_000 + "'>"
    s, _ = run_errors(ErrorGrid(bad=(2,), code=lambda k: 2, reason=reason), budget=100.0)
    assert len(run_of(s).manager.books.first_failure[1]) == DETAIL_LIMIT
    with pytest.raises(RunFailed) as info:
        run_errors(ErrorGrid(bad=(1, 2, 3), code=lambda k: 2, reason=reason, every=1), budget=100.0)
    lines = [r.getMessage() for r in caplog.records] + [str(info.value)]
    assert any("set aside" in ln for ln in lines) and any("lost the reply" in ln for ln in lines)
    assert all("\n" not in ln and "\r" not in ln and "\x1b" not in ln and len(ln) < 2000 for ln in lines), \
        max(map(len, lines))


class MetricFloodGrid(InProcessGrid):
    """``hostile``'s four nodes; partition 2's replies carry 1,000 metric names never seen before."""

    def __init__(self) -> None:
        super().__init__(hostile.app, hostile.N)
        self.k = 0

    def _execute(self, msg):
        rep = super()._execute(msg)
        if msg.metadata.message_type == "train" and msg.metadata.dst_node_id == self.node_ids[2]:
            self.k += 1
            rep.content["metrics"] = MetricRecord({**rep.content["metrics"],
                                                   **{f"m{self.k}-{j}": 1.0 for j in range(1000)}})
        return rep


@pytest.mark.parametrize("custom", [False, True])
def test_fresh_metric_names_in_every_reply_are_bounded_per_window(custom, caplog):
    """The window of reply metrics keeps at most MAX_METRIC_KEYS names (FedAvg's aggregation, or a
    custom one that sees the kept replies); the rest are dropped with one warning, and the history
    and the checkpointed state stay small."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    s = STRATEGIES["rescaled"](fraction_evaluate=0.0, train_metrics_aggr_fn=aggregate_metricrecords if custom else None)
    res = start_run(s, MetricFloodGrid(), ArrayRecord({"w": Array(np.zeros(hostile.DIM, np.float32))}), time_budget=100.0,
                  clock=VirtualClock(DelayModel(hostile.TAUS)), train_config={"reply": "gradient"},
                  partition_query=True, num_evaluations=10)
    assert res.books["updates"] > 100
    rows = list(res.train_metrics_clientapp.values())
    assert len(rows) == 10 and all(0 < len(r) <= MAX_METRIC_KEYS for r in rows), [len(r) for r in rows]
    assert all("loss" in r for r in rows)  # (the honest name, seen first, is kept)
    assert sum("names dropped" in r.getMessage() for r in caplog.records) == 1


def test_a_metric_list_longer_than_the_bound_is_dropped(caplog):
    from fl_rescaled.messages import MAX_METRIC_LIST, reply_metrics

    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    rec = MetricRecord({"per-class": [0.5] * MAX_METRIC_LIST, "flood": [1.0] * 1_000_000, "loss": 1.0})
    assert sorted(reply_metrics(RecordDict({"metrics": rec}))) == ["loss", "per-class"]
    assert any("'flood' was dropped" in r.getMessage() and "at most 1000" in r.getMessage() for r in caplog.records)
