"""The run's books: per-worker counters and times, rejections by reason, and their summaries."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord

from .jobs import Job


@dataclass
class WorkerBook:
    node_id: int
    updates: int = 0
    stepsize_sum: float = 0.0
    jobs_sent: int = 0
    jobs_done: int = 0
    rejected: int = 0
    lost: int = 0
    discarded: int = 0  # jobs whose (partial) work was thrown away
    wasted: float = 0.0  # compute time of those jobs
    busy_done: float = 0.0  # compute time of finished or cancelled jobs
    free_at: float = 0.0  # virtual time at which the worker's queue empties
    online: bool = True  # wall clock: False after its node was reported gone, until it reappears
    last_delivery: float = math.nan  # wall clock: time.monotonic() of the last accepted reply
    last_version: int = -1  # the model version this worker was last sent ...
    last_model: ArrayRecord | None = None  # ... and that model, encoded
    pending: dict[str, Job] = field(default_factory=dict)  # its jobs in flight, by message id
    #: How each finished job ended: "applied", "unused" (accepted, then not used by the strategy),
    #: "cancelled", "rejected.<reason>" (a reply that must not touch the model) or "lost.<reason>"
    #: (no reply: the node is gone, the TTL expired, the ClientApp process crashed).
    outcomes: Counter[str] = field(default_factory=Counter)


#: Reasons for which a job counts as lost rather than rejected: no reply came (the job, not its
#: reply, went wrong). Flower's codes: 3 message unavailable, 5 node unavailable, 8 ClientApp crashed.
LOST = ("lost", "ttl-expired", "error-code-3", "error-code-5", "error-code-8")


class Books:
    """Everything the manager counts: per worker (``workers``) and for the run."""

    def __init__(self, node_ids: list[int]) -> None:
        self.workers = [WorkerBook(node_id=n) for n in node_ids]
        self.version = 0  # k: server updates applied so far
        self.stepsize_sum = 0.0
        self.rejections: Counter[str] = Counter()
        self.first_rejection: tuple[str, str] | None = None  # (reason, detail) of the first one
        self.accepted = 0  # replies that passed validation

    def record_update(self, worker: int, stepsize: float) -> None:
        self.version += 1
        self.stepsize_sum += stepsize
        book = self.workers[worker]
        book.updates += 1
        book.stepsize_sum += stepsize

    def record_rejection(self, reason: str, detail: str = "") -> None:
        self.rejections[reason] += 1
        if self.first_rejection is None and reason not in ("duplicate", "unknown-job"):
            self.first_rejection = (reason, detail)

    def finished(self, worker: int, outcome: str) -> None:
        """Book how one of ``worker``'s jobs ended (see ``WorkerBook.outcomes``)."""
        self.workers[worker].outcomes[outcome] += 1

    def unused(self, worker: int) -> None:
        """An accepted reply the strategy threw away (a late job of an earlier round)."""
        outcomes = self.workers[worker].outcomes
        outcomes["applied"] -= 1
        outcomes["unused"] += 1

    def balance(self) -> list[dict[str, int]]:
        """Per worker: jobs sent = applied + rejected (by reason) + lost + discarded + in flight.

        Each row has those numbers and ``balanced`` (1 or 0); ``discarded`` is cancelled plus unused.
        """
        rows = []
        for b in self.workers:
            o = b.outcomes
            row = {"sent": b.jobs_sent, "applied": o["applied"],
                   "rejected": sum(v for k, v in o.items() if k.startswith("rejected.")),
                   "lost": sum(v for k, v in o.items() if k.startswith("lost.")),
                   "discarded": o["cancelled"] + o["unused"], "in-flight": len(b.pending)}
            accounted = row["applied"] + row["rejected"] + row["lost"] + row["discarded"] + row["in-flight"]
            row["balanced"] = int(accounted == row["sent"] and o["applied"] >= 0)
            rows.append(row)
        return rows

    def check_balance(self) -> None:
        """Raise AssertionError naming the first worker whose books do not balance."""
        for i, row in enumerate(self.balance()):
            if not row["balanced"]:
                raise AssertionError(
                    f"the books do not balance for worker {i}: {row['sent']} jobs sent, but {row['applied']} applied + "
                    f"{row['rejected']} rejected + {row['lost']} lost + {row['discarded']} discarded + "
                    f"{row['in-flight']} in flight ({dict(self.workers[i].outcomes)})")

    def busy_time(self, worker: int, t: float, virtual: bool) -> float:
        """Time ``worker`` spent computing up to time ``t``."""
        book = self.workers[worker]
        busy = book.busy_done
        if virtual:
            for job in book.pending.values():
                if job.start_time < t:
                    busy += min(job.finish_time, t) - job.start_time
        return busy

    def idle_share(self, worker: int, t: float, virtual: bool) -> float:
        if t <= 0:
            return 0.0
        return max(0.0, 1.0 - self.busy_time(worker, t, virtual) / t)

    def summary(self, t: float, virtual: bool) -> dict[str, Any]:
        """The per-evaluation row of the books (touches every worker: per evaluation, not per event)."""
        ws = self.workers
        return {
            "updates": self.version,
            "cumulative_stepsize": self.stepsize_sum,
            "updates_per_worker": [b.updates for b in ws],
            "rejected": dict(self.rejections),
            "lost_per_worker": [b.lost for b in ws],
            "discarded_per_worker": [b.discarded for b in ws],
            "wasted_time": sum(b.wasted for b in ws),
            "idle_share_per_worker": [self.idle_share(i, t, virtual) for i in range(len(ws))],
        }

    def totals(self, in_flight: int, now: float) -> dict[str, int | float]:
        """The run's books as flat numbers (``AsyncResult.books``): jobs sent, replies accepted,
        updates, rejections in all and per reason, lost and discarded jobs, jobs still in flight."""
        ws = self.workers
        out: dict[str, int | float] = {
            "updates": self.version,
            "jobs-sent": sum(b.jobs_sent for b in ws),
            "replies-accepted": self.accepted,
            "rejected": sum(self.rejections.values()),
            "lost": sum(b.lost for b in ws),
            "discarded": sum(b.discarded for b in ws),
            "in-flight": in_flight,
            "cumulative-stepsize": self.stepsize_sum,
            "time": float(now),
        }
        for reason, count in sorted(self.rejections.items()):
            out[f"rejected.{reason}"] = count
        rows = self.balance()
        for key in ("sent", "applied", "rejected", "lost", "discarded", "in-flight"):
            out[f"{key}-per-worker"] = [r[key] for r in rows]
        out["balanced"] = int(all(r["balanced"] for r in rows))
        return out
