#!/usr/bin/env python
"""What the order of the jobs alone could gain with ``--workers 2``: the paper's run replayed.

``bench_stack.py`` prints, after its table, where a ``--workers 2`` update's time goes: the event
loop's own work ``L`` an update, the worker process's ``W`` a job, and ``S`` for each job the loop
computes itself because the worker had not started it when its reply was wanted. This script takes
those three costs and the run's own event order (which job is sent, which reply is wanted, in the
order the strategy does it: recorded from a ``--workers 1`` run of the same spec, whose order is the
same) and replays the two processes on that order with a few ways of sharing the jobs:

- ``sent``: the worker takes the jobs in the order they were sent, and the loop computes a wanted job
  the worker has not started and waits for one it has (what the project does);
- ``wanted``: the worker takes the unstarted job whose reply is wanted first;
- ``wanted, keep``: the same, and a job is kept for the loop when it is sent if the worker's queue
  (the job it computes, then every queued job wanted before this one) would end later than the loop,
  at ``L`` an update plus a slack, reaches the reply.

Each cost is drawn per job or update, uniformly within ``± --spread`` of its mean, and each row is
the mean over ``--seeds`` draws. The replay knows each reply's turn when its job is sent, which the
project's Grid does not; it has no noise from the host (the measured run's loop is about 94 % busy),
so compare its rows with each other and with ``sent``, not with a timing. It holds each cost fixed,
so it cannot judge a change that moves work from one process to the other: the minibatch's draw
moved into the worker replayed 2–3 % faster (``L`` 20–25 µs less, ``W`` 10–12 more) and measured
slower, ``L`` 16–17 µs less but the worker's job 62–93 µs dearer (``docs/performance-log.md``,
twenty-second round).

    python benchmarks/replay_schedule.py --loop 240 --steal 520 --job 310 [--updates 6000] [--bare 2850]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fl_rescaled.manager.observers import ManagerObserver  # noqa: E402

Event = tuple[str, int]  # ("sent" | "wanted", job id)


class EventOrder(ManagerObserver):
    """The jobs sent and the replies wanted (``completed``), in the order the strategy meets them."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def job_sent(self, job) -> None:
        self.events.append(("sent", job.job_id))

    def completed(self, comp) -> None:
        self.events.append(("wanted", comp.job.job_id))


def replay(events: list[Event], loop: float, steal: float, job: float, order: str = "sent",
           slack: float | None = None, spread: float = 0.0, seed: int = 0) -> dict[str, float]:
    """The two processes on ``events``: the loop spends ``loop`` µs after each wanted reply, ``steal``
    for a job it computes, and the worker ``job`` a job, taken in ``order`` (``sent`` or ``wanted``);
    with ``slack`` (``wanted`` order), a job the worker would finish after the loop wants it (as
    projected when it is sent, the loop given ``slack`` µs more) is kept for the loop. Returns ``T``
    (µs an update), ``steals`` and ``waited`` (µs) an update."""
    rng = np.random.default_rng(seed)

    def cost(mean: float) -> float:
        return mean * rng.uniform(1 - spread, 1 + spread) if spread else mean

    turn: dict[int, int] = {}  # job -> the index of the wanted event that needs it
    for i, (kind, jid) in enumerate(e for e in events if e[0] == "wanted"):
        turn[jid] = i
    never = len(events)
    t = free = 0.0  # the loop's clock; when the worker is free
    queued: list[tuple[float, int]] = []  # (sent at, job), in the order sent
    running: tuple[int, float] | None = None  # (job, ends at)
    done: set[int] = set()
    steals = 0
    waited = 0.0
    updates = 0

    def advance(until: float) -> None:
        nonlocal running, free
        while True:
            if running is not None:
                if running[1] > until:
                    return
                done.add(running[0])
                free, running = running[1], None
            if not queued:
                return
            start = max(free, queued[0][0])  # (queued in the order sent: the earliest first)
            if start > until:
                return
            ready = [q for q in queued if q[0] <= start]
            pick = ready[0] if order == "sent" else min(ready, key=lambda q: (turn.get(q[1], never), q[0]))
            queued.remove(pick)
            running = (pick[1], start + cost(job))

    for kind, jid in events:
        if kind == "sent":
            if slack is not None:
                advance(t)
                ahead = sum(1 for _, q in queued if turn.get(q, never) < turn.get(jid, never))
                ends = max(t, running[1] if running else free) + job * (ahead + 1)
                if ends > t + (turn.get(jid, never) - updates) * loop + slack:
                    continue  # (kept: when wanted it is neither done, running nor queued)
            queued.append((t, jid))
            continue
        advance(t)
        if jid in done:
            done.discard(jid)
        elif running is not None and running[0] == jid:
            waited += running[1] - t
            t = running[1]
            advance(t)
            done.discard(jid)
        else:  # kept, or queued and not started: the loop computes it
            queued[:] = [q for q in queued if q[1] != jid]
            steals += 1
            t += cost(steal)
        t += cost(loop)
        updates += 1
    return {"T": t / updates, "steals": steals / updates, "waited": waited / updates}


def record(n_updates: int) -> list[Event]:
    """The paper's run's event order (``bench_stack.paper_run``, ``--workers 1``)."""
    from bench_stack import paper_run

    seen = EventOrder()
    paper_run(n_updates, 1, observers=[seen])
    return seen.events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loop", type=float, required=True, help="the event loop's own work, µs an update (L)")
    ap.add_argument("--steal", type=float, required=True, help="a job the loop computes, µs (S)")
    ap.add_argument("--job", type=float, required=True, help="a job in the worker process, µs (W)")
    ap.add_argument("--updates", type=int, default=6000)
    ap.add_argument("--spread", type=float, default=0.15)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--bare", type=float, default=None, help="the 1-thread bare loop's steps/s, for ratios")
    args = ap.parse_args()
    for flag in ("loop", "steal", "job"):
        if not 0 <= getattr(args, flag) < float("inf"):
            ap.error(f"--{flag} is a cost in µs: a finite number ≥ 0, got {getattr(args, flag)}")
    if not 0 <= args.spread < 1:
        ap.error(f"--spread draws each cost within ± that share of it: from 0 up to (not) 1, got {args.spread}")
    if args.updates < 1 or args.seeds < 1:
        ap.error("--updates and --seeds must be at least 1")
    if args.bare is not None and not 0 < args.bare < float("inf"):
        ap.error(f"--bare is the bare loop's steps/s: a finite number > 0, got {args.bare}")
    from bench_stack import balanced_bound

    events = record(args.updates)
    L, S, W = args.loop, args.steal, args.job
    best, f = balanced_bound(L, S, W)
    rows = {"balanced bound (no order reaches it)": {"T": best, "steals": f, "waited": 0.0}}
    policies = [("sent", None), ("wanted", None)] + [("wanted", s) for s in (300, 400, 500, 600, 700)]
    for order, slack in policies:
        runs = [replay(events, L, S, W, order, slack, args.spread, seed) for seed in range(args.seeds)]
        name = order if slack is None else f"{order}, keep (slack {slack:g} µs)"
        rows[name] = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
    print(f"the paper's run, {sum(k == 'wanted' for k, _ in events)} updates; L {L:g}, S {S:g}, W {W:g} µs, "
          f"spread ±{args.spread:.0%}, mean of {args.seeds} draws")
    for name, r in rows.items():
        ratio = f"  ×{1e6 / r['T'] / args.bare:.2f} of the bare loop" if args.bare else ""
        print(f"  {name:<40}{r['T']:6.0f} µs an update  {r['steals']:.3f} computed by the loop  "
              f"{r['waited']:5.1f} µs waited{ratio}")


if __name__ == "__main__":
    main()
