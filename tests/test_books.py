"""Books that balance: for every worker, jobs sent = applied + rejected + lost + discarded + in flight,
whatever the method (cancelled rounds, late replies, queues, buffers)."""

from __future__ import annotations

import pytest

from conftest import assert_books_balance, quad
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
