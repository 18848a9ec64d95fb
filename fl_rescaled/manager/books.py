"""The run's books: what happened to every job, per worker, written in one place.

Every job sent ends in exactly one outcome, and ``Books.ended`` is the only place that writes it:

- ``applied``: its reply passed validation and reached the strategy;
- ``unused``: its reply passed validation, then the strategy did not use it (a late job of an
  earlier round; ``Books.unused`` moves it from ``applied``);
- ``cancelled``: the strategy stopped it (a Malenia round closed);
- ``rejected.<reason>``: its reply must not touch the model (``malformed``, ``non-finite``, ...);
- ``lost.<reason>``: no usable reply came (the node left, the TTL expired, the ClientApp raised or
  crashed: Flower's error replies, ``error-code-N``; a restarted server, ``resumed``).

Every total is derived from those per-worker counts, so the run's totals always equal the sums
of the per-worker rows, and ``check_balance`` asserts, per worker, that jobs sent = applied +
rejected + lost + discarded (cancelled + unused) + in flight. Replies that answer no job in flight
(a second reply to the same job, a reply to a job never sent) are not job outcomes: they are
counted as ``stray.<reason>``.

``strikes`` counts, per worker, its jobs that failed in a row (``is_strike``: a rejection, or a
lost job the client is to blame for; an applied reply resets it): the manager sets aside a worker
with too many (``AsyncClientManager``).

The table is bounded whatever the clients send (``reason_key``): Flower's own error codes
(``ErrorCode``) keep a key each, the first ``UNKNOWN_CODES`` other integer codes too, and every
further code (or a code that is no integer) is pooled as ``error-code-other``; at most
``MAX_OUTCOMES`` keys in all (a checkpoint with more is refused), and a failure's detail is kept to
``DETAIL_LIMIT`` characters.

The per-worker numbers are numpy arrays (a population of 100,000 clients costs a few MB).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.common.constant import ErrorCode

log = logging.getLogger("flwr.fl_rescaled")

#: Reasons for which a job counts as lost (no usable reply came) rather than rejected: our own
#: TTL expiry, a restarted server, a client that went offline, and every Flower error reply (``error-code-N``: the ClientApp
#: raised (2) or crashed (8), the message (3) or the node (5) became unavailable).
LOST_REASONS = ("lost", "ttl-expired", "resumed", "offline")

#: Lost reasons that say nothing about the client, so no strike: its node left or went offline,
#: Flower's message or reply expired in transit (MESSAGE_UNAVAILABLE 3, REPLY_MESSAGE_UNAVAILABLE 4,
#: NODE_UNAVAILABLE 5), the server restarted. Availability deals with them. Every other failure is
#: a strike: a rejection, an error reply of the ClientApp (it raised: 2, crashed: 8, could not be
#: loaded: 1, ...), and no reply within the job's TTL from a node still there (``ttl-expired``;
#: ``lost`` on the virtual clock), which a round would otherwise wait a whole TTL for, every time.
NOT_A_STRIKE = ("offline", "resumed", "error-code-3", "error-code-4", "error-code-5")

#: Flower's error codes: each keeps its own key in the books.
KNOWN_CODES = frozenset(v for k, v in vars(ErrorCode).items() if k.isupper() and isinstance(v, int))
#: Other integer error codes with a key of their own (the first ones seen); the rest share one.
UNKNOWN_CODES = 4
OTHER_CODE = "error-code-other"
_CODE = re.compile(r"error-code-(-?[0-9]{1,18})")
#: The most outcome keys the books hold: applied, unused, cancelled, our own rejection reasons, the
#: lost reasons, Flower's codes, ``UNKNOWN_CODES`` and the pooled one, with room to spare.
MAX_OUTCOMES = 48
#: Characters kept of a failure's detail (a client's error text can be megabytes).
DETAIL_LIMIT = 2000

#: Evaluation rows carry per-worker lists up to this many workers (a population's would not fit:
#: 100,000 clients × 200 evaluations); beyond, their means and extremes.
PER_WORKER_ROWS = 1000

#: What ``Books.balance`` reports per worker, in order.
COLUMNS = ("sent", "applied", "rejected", "lost", "discarded", "in-flight")


def is_lost(reason: str) -> bool:
    return reason in LOST_REASONS or reason.startswith("error-code")


def outcome_of(reason: str) -> str:
    """The outcome key of a job that failed for ``reason``: ``lost.<reason>`` or ``rejected.<reason>``."""
    return f"{'lost' if is_lost(reason) else 'rejected'}.{reason}"


def _code_of(reason: str) -> int | None:
    """The integer N of an ``error-code-N`` reason (None for any other reason)."""
    m = _CODE.fullmatch(reason)
    return int(m.group(1)) if m else None


def is_strike(outcome: str) -> bool:
    """Whether a job that ended with ``outcome`` counts against its client (see ``NOT_A_STRIKE``)."""
    return outcome.startswith("rejected.") or (outcome.startswith("lost.") and outcome[5:] not in NOT_A_STRIKE)


def _zeros(dtype: type) -> Any:
    return field(default_factory=lambda: np.zeros(0, dtype))


@dataclass
class Books:
    """Per-worker counts and times, and the run's update counter; see the module docstring.

    A dataclass of arrays and numbers: it is part of the run's state as it is (checkpoints).
    """

    n: int = 0
    jobs_sent: np.ndarray = _zeros(np.int64)
    in_flight: np.ndarray = _zeros(np.int64)
    updates: np.ndarray = _zeros(np.int64)
    stepsize_per_worker: np.ndarray = _zeros(np.float64)
    busy_done: np.ndarray = _zeros(np.float64)  # compute time of the jobs that ended
    wasted: np.ndarray = _zeros(np.float64)  # compute time of the discarded ones
    outcomes: dict[str, np.ndarray] = field(default_factory=dict)
    version: int = 0  # k: server updates applied so far
    stepsize_sum: float = 0.0
    stray: dict[str, int] = field(default_factory=dict)
    first_failure: tuple[str, str] | None = None  # (reason, detail) of the first failed job
    strikes: np.ndarray = _zeros(np.int64)  # per worker: its jobs failed in a row (``is_strike``)

    @classmethod
    def sized(cls, num_workers: int) -> Books:
        n = int(num_workers)
        return cls(n, *(np.zeros(n, np.int64) for _ in range(3)), *(np.zeros(n, np.float64) for _ in range(3)),
                   strikes=np.zeros(n, np.int64))

    def check(self) -> None:
        """Shapes, dtypes and signs of a books record read from a file; the updates add up to the
        model's version, and every worker's jobs balance."""
        named = {"jobs_sent": self.jobs_sent, "in_flight": self.in_flight, "updates": self.updates,
                 "strikes": self.strikes,
                 **{f"outcomes[{k!r}]": v for k, v in self.outcomes.items()}}
        for name, a in named.items():
            if a.dtype != np.int64 or a.shape != (self.n,):
                raise ValueError(f"books: {name} must be {self.n} int64 counts")
        for name in ("stepsize_per_worker", "busy_done", "wasted"):
            a = getattr(self, name)
            if a.dtype != np.float64 or a.shape != (self.n,) or not np.isfinite(a).all():
                raise ValueError(f"books: {name} must be {self.n} finite float64 values")
        if len(self.outcomes) > MAX_OUTCOMES or len(self.stray) > MAX_OUTCOMES:
            raise ValueError(f"books: {max(len(self.outcomes), len(self.stray))} outcome keys, more than the "
                             f"{MAX_OUTCOMES} a run can make")
        for key in self.outcomes:
            if (key not in ("applied", "unused", "cancelled") and not key.startswith(("rejected.", "lost."))) \
                    or len(key) > 100:
                raise ValueError(f"books: unknown outcome {key[:100]!r}")
        counts = (self.jobs_sent, self.in_flight, self.updates, self.strikes, *self.outcomes.values())
        if self.version < 0 or any((c < 0).any() for c in counts):
            raise ValueError("books: negative counts")
        if int(self.updates.sum()) != self.version:
            raise ValueError(f"books: {self.version} updates applied, and the workers' updates add up to "
                             f"{int(self.updates.sum())}")
        try:
            self.check_balance()
        except AssertionError as exc:
            raise ValueError(f"books: {exc}") from None

    # ------------------------------------------------------------------ writers
    def sent(self, worker: int) -> int:
        """A job was sent to ``worker``; returns its number among the worker's jobs (0, 1, ...)."""
        seq = int(self.jobs_sent[worker])
        self.jobs_sent[worker] = seq + 1
        self.in_flight[worker] += 1
        return seq

    def reason_key(self, reason: str) -> str:
        """``reason`` as the books keep it: an ``error-code-N`` of Flower's, or one of the first
        ``UNKNOWN_CODES`` other integer codes, as it is; any other error code ``error-code-other``.
        (Our own reasons are a fixed set, kept as they are.)"""
        if not reason.startswith("error-code-"):
            return reason
        code = _code_of(reason)
        if code is None:
            return OTHER_CODE
        key = f"error-code-{code}"
        if code in KNOWN_CODES or f"lost.{key}" in self.outcomes:
            return key
        unknown = sum(1 for k in self.outcomes if k.startswith("lost.") and _code_of(k[5:]) not in (None, *KNOWN_CODES))
        return key if unknown < UNKNOWN_CODES else OTHER_CODE

    def ended(self, worker: int, outcome: str, detail: str = "") -> None:
        """One of ``worker``'s jobs ended with ``outcome`` (see the module docstring); a failure's
        ``detail`` is kept (truncated) when it is the run's first."""
        self.in_flight[worker] -= 1
        counts = self.outcomes.get(outcome)
        if counts is None:
            if len(self.outcomes) >= MAX_OUTCOMES - 2:  # (a bug would have to make that many reasons)
                pooled = f"lost.{OTHER_CODE}" if outcome.startswith("lost.") else "rejected.other"
                log.warning("the books hold %d outcome keys: %r is counted as %r", len(self.outcomes),
                            outcome[:100], pooled)
                outcome = pooled
            counts = self.outcomes.get(outcome)
            if counts is None:
                counts = self.outcomes[outcome] = np.zeros(self.n, np.int64)
        counts[worker] += 1
        if outcome == "applied":
            self.strikes[worker] = 0
        elif is_strike(outcome):
            self.strikes[worker] += 1
        if self.first_failure is None and outcome.startswith(("rejected.", "lost.")):
            self.first_failure = (outcome.split(".", 1)[1], detail[:DETAIL_LIMIT])

    def unused(self, worker: int) -> None:
        """An applied reply the strategy then threw away: its outcome becomes ``unused``."""
        self.outcomes["applied"][worker] -= 1
        self.in_flight[worker] += 1  # (ended() takes it off again)
        self.ended(worker, "unused")

    def record_stray(self, reason: str) -> None:
        """A reply that answers no job in flight (``duplicate``, ``unknown-job``)."""
        self.stray[reason] = self.stray.get(reason, 0) + 1

    def record_update(self, worker: int, stepsize: float) -> None:
        self.version += 1
        self.stepsize_sum += stepsize
        self.updates[worker] += 1
        self.stepsize_per_worker[worker] += stepsize

    # ------------------------------------------------------------------ readers
    def count(self, prefix: str) -> np.ndarray:
        """Per worker: jobs whose outcome is ``prefix`` or starts with ``prefix.``."""
        total = np.zeros(self.n, np.int64)
        for key, counts in self.outcomes.items():
            if key == prefix or key.startswith(prefix + "."):
                total += counts
        return total

    def by_reason(self, kind: str) -> dict[str, int]:
        """Run totals of ``kind`` (``rejected`` or ``lost``) outcomes by reason."""
        return {key.split(".", 1)[1]: int(c.sum()) for key, c in sorted(self.outcomes.items())
                if key.startswith(kind + ".") and c.any()}

    def failures(self) -> dict[str, int]:
        """Rejected and lost jobs by reason (what the run's ``rejected`` column shows)."""
        return {**self.by_reason("rejected"), **self.by_reason("lost")}

    @property
    def accepted(self) -> int:
        """Replies that passed validation (applied or unused)."""
        return int(self.count("applied").sum() + self.count("unused").sum())

    @property
    def trainings(self) -> int:
        """Client trainings delivered: replies accepted (applied or unused) or rejected (a client's
        training that reached the server, used or not); lost jobs (no reply, an error reply) are not
        trainings. What ``num_trainings`` counts."""
        return self.accepted + int(self.count("rejected").sum())

    def per_worker(self) -> dict[str, np.ndarray]:
        """The balance's columns as arrays (``COLUMNS``)."""
        return {"sent": self.jobs_sent, "applied": self.count("applied"), "rejected": self.count("rejected"),
                "lost": self.count("lost"), "discarded": self.count("cancelled") + self.count("unused"),
                "in-flight": self.in_flight}

    def balance(self) -> list[dict[str, int]]:
        """Per worker: the ``COLUMNS`` and ``balanced`` (1 when sent equals the rest's sum)."""
        cols = self.per_worker()
        ok = self._balanced(cols)
        return [{**{k: int(cols[k][i]) for k in COLUMNS}, "balanced": int(ok[i])} for i in range(self.n)]

    @staticmethod
    def _balanced(cols: dict[str, np.ndarray]) -> np.ndarray:
        accounted = cols["applied"] + cols["rejected"] + cols["lost"] + cols["discarded"] + cols["in-flight"]
        return (accounted == cols["sent"]) & (cols["applied"] >= 0) & (cols["in-flight"] >= 0)

    def check_balance(self) -> None:
        """Raise AssertionError naming the first worker whose books do not balance."""
        cols = self.per_worker()
        bad = np.flatnonzero(~self._balanced(cols))
        if bad.size:
            i = int(bad[0])
            c = {k: int(cols[k][i]) for k in COLUMNS}
            raise AssertionError(
                f"the books do not balance for worker {i}: {c['sent']} jobs sent, but {c['applied']} applied + "
                f"{c['rejected']} rejected + {c['lost']} lost + {c['discarded']} discarded + {c['in-flight']} in flight")

    def totals(self, now: float) -> dict[str, Any]:
        """The run's books as flat numbers and per-worker lists (``AsyncResult.books``); every total is
        the sum of its per-worker list."""
        cols = self.per_worker()
        out: dict[str, Any] = {"updates": self.version, "jobs-sent": int(cols["sent"].sum()),
                               "replies-accepted": self.accepted, "trainings": self.trainings}
        for key in COLUMNS[2:]:
            out[key] = int(cols[key].sum())
        out["cumulative-stepsize"] = self.stepsize_sum
        out["time"] = float(now)
        for kind in ("rejected", "lost"):
            for reason, count in self.by_reason(kind).items():
                out[f"{kind}.{reason}"] = count
        for reason, count in sorted(self.stray.items()):
            out[f"stray.{reason}"] = count
        if self.n <= PER_WORKER_ROWS:
            for key in COLUMNS:
                out[f"{key}-per-worker"] = cols[key].tolist()
        out["balanced"] = int(self._balanced(cols).all())
        return out

    def summary(self, t: float, busy: np.ndarray, per_worker: bool | None = None) -> dict[str, Any]:
        """The per-evaluation row of the books; ``busy``: each worker's compute time up to ``t``.
        Per-worker lists when ``per_worker`` (default: up to ``PER_WORKER_ROWS`` workers), else the
        updates' and idle shares' means and extremes."""
        idle = np.maximum(0.0, 1.0 - busy / t) if t > 0 else np.zeros(self.n)
        row: dict[str, Any] = {"updates": self.version, "cumulative_stepsize": self.stepsize_sum,
                               "rejected": self.failures(), "wasted_time": float(self.wasted.sum()),
                               "idle_share_mean": float(idle.mean()) if self.n else 0.0}
        if self.n <= PER_WORKER_ROWS if per_worker is None else per_worker:
            row.update(updates_per_worker=self.updates.tolist(), lost_per_worker=self.count("lost").tolist(),
                       discarded_per_worker=(self.count("cancelled") + self.count("unused")).tolist(),
                       idle_share_per_worker=idle.tolist())
        else:
            row.update(updates_min=int(self.updates.min()), updates_max=int(self.updates.max()),
                       workers_updated=int(np.count_nonzero(self.updates)), idle_share_min=float(idle.min()))
        return row
