"""Who gets the next job: the seam between a strategy that wants work done and the population.

A strategy asks for "a job on the current model" when a slot frees (``send_next``); the selector
decides which worker runs it, or that none can now (the slot then waits until a worker is back).

- ``SameWorker``: the worker whose job just ended runs the next one. Every worker is always busy:
  the paper's asynchronous SGD (concurrency C = N, the default).
- With C < N a freed slot goes to an idle (no job in flight), online worker that the run's
  *selection* picks, a subclass of ``IdleSelector`` registered by name in ``SELECTORS``:

  - ``uniform`` (``UniformIdle``, the default): drawn uniformly with the run's seeded generator,
    as FedBuff, Papaya or FLSim sample a population. The worker whose job just ended is among the
    candidates.
  - ``round-robin`` (``RoundRobin``): the workers take turns in a seeded order (cyclic
    participation), a busy or offline worker passed over until the next cycle.

``Population`` holds the run's concurrency, its selector and the slots that wait. The idle workers
are kept in an array with each worker's position (swap-remove), so the uniform draw is O(1) per job
whatever N: an offline draw is redrawn (up to a few times, then the online idle workers are listed
once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from fl_rescaled.clock import VirtualClock
from fl_rescaled.stepsizes import TauTable, delivery_periods

Online = Callable[[int], bool]
OnlineMask = Callable[[np.ndarray], np.ndarray]


class Selector(Protocol):
    """Chooses the worker of the next job."""

    def next_worker(self, after: int | None) -> int | None:
        """The worker that runs the next job, now that worker ``after``'s job ended (None: a job
        that follows no other, at the start); None when no worker can take it now."""

    def busy(self, worker: int) -> None:
        """A job was sent to ``worker``."""

    def idle(self, worker: int) -> None:
        """``worker`` has no job in flight any more."""


class SameWorker:
    """The worker whose job just ended runs the next one, if it is online (else the slot waits for
    it: it gets work again when it comes back)."""

    def __init__(self, online: Online) -> None:
        self.online = online

    def next_worker(self, after: int | None) -> int | None:
        if after is None:
            raise ValueError("every worker is always busy here: a job goes to a named worker")
        return after if self.online(after) else None

    def busy(self, worker: int) -> None:
        pass

    def idle(self, worker: int) -> None:
        pass


@dataclass
class IdlePool:
    """The idle workers, with O(1) add, remove and uniform draw (an array and each worker's position)."""

    items: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # -1: not idle
    size: int = 0

    @classmethod
    def all_idle(cls, n: int) -> IdlePool:
        return cls(np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64), n)

    def add(self, w: int) -> None:
        if self.pos[w] < 0:
            self.items[self.size] = w
            self.pos[w] = self.size
            self.size += 1

    def remove(self, w: int) -> None:
        i = self.pos[w]
        if i >= 0:
            last = self.items[self.size - 1]
            self.items[i] = last
            self.pos[last] = i
            self.pos[w] = -1
            self.size -= 1

    def check(self) -> None:
        n = len(self.pos)
        if self.items.shape != (n,) or not 0 <= self.size <= n:
            raise ValueError("idle pool: sizes do not match")
        members = self.items[: self.size]
        if (members < 0).any() or (members >= n).any() or (self.pos[members] != np.arange(self.size)).any() \
                or int((self.pos >= 0).sum()) != self.size:
            raise ValueError("idle pool: positions do not match")


class IdleSelector:
    """The base of every selector of a sampled population (C < N): the idle workers (``pool``), the
    run's seeded generator (``rng``) and who is online. A subclass says which idle, online worker
    runs the next job (``pick``, called only when some worker is idle). A selector that keeps state
    of its own keeps it in named arrays (``arrays``; written into the run's checkpoint as data and
    given back to ``restore_arrays``), built from the generator when it starts.

    A selector is registered by name in ``SELECTORS``; strategies take the name (``selection``), so
    it reaches the command line (``--selection``), the run config, checkpoints and fingerprints.
    """

    #: Its name in ``SELECTORS`` (and in a checkpoint).
    name = ""

    def __init__(self, n: int, rng: np.random.Generator, online: Online, online_mask: OnlineMask,
                 pool: IdlePool | None = None) -> None:
        self.n = n
        self.rng = rng
        self.online = online
        self.online_mask = online_mask
        self.pool = pool if pool is not None else IdlePool.all_idle(n)

    def next_worker(self, after: int | None) -> int | None:
        return None if self.pool.size == 0 else self.pick(after)

    def pick(self, after: int | None) -> int | None:
        """An idle, online worker for the next job (``after``: the worker whose job just ended, or None),
        or None when every idle worker is offline."""
        raise NotImplementedError

    def busy(self, worker: int) -> None:
        self.pool.remove(worker)

    def idle(self, worker: int) -> None:
        self.pool.add(worker)

    def idle_workers(self) -> np.ndarray:
        return self.pool.items[: self.pool.size].copy()

    def online_idle(self) -> np.ndarray:
        """The idle workers that are online now (listed: O(idle workers))."""
        idle = self.pool.items[: self.pool.size]
        return idle[self.online_mask(idle)]

    def arrays(self) -> dict[str, np.ndarray]:
        """The selector's own state besides the pool and the generator (none here)."""
        return {}

    def restore_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Go on from ``arrays`` (from ``arrays()``, read from a checkpoint); ValueError if they do not fit."""
        if arrays:
            raise ValueError(f"the {self.name} selection keeps no arrays; the checkpoint has {sorted(arrays)}")


class UniformIdle(IdleSelector):
    """A worker drawn uniformly from the idle, online workers (seeded); see the module docstring."""

    name = "uniform"
    TRIES = 8  # redraws of an offline worker before the online idle workers are listed

    def pick(self, after: int | None) -> int | None:
        pool = self.pool
        for _ in range(self.TRIES):
            w = int(pool.items[int(self.rng.integers(pool.size))])
            if self.online(w):
                return w
        up = self.online_idle()
        return int(up[int(self.rng.integers(up.size))]) if up.size else None


class RoundRobin(IdleSelector):
    """Cyclic participation: the workers take turns in a fixed order, a seeded permutation drawn when
    the run starts. The next job goes to the first idle, online worker at or after the turn, and the
    turn moves past it. A worker that is busy or offline when its turn comes is passed over until the
    next cycle. Each worker is then chosen about once per cycle of N selections, which the
    uniform draw only does on average. Cost per job: the workers passed over (busy or offline), the
    first few one by one, then in blocks (with 100,000 clients and C = 1,000, 0.86× the uniform
    draw's updates per second on the quadratic task).
    """

    name = "round-robin"
    ONE_BY_ONE = 8  # workers looked at one at a time before the search goes on in blocks
    BLOCK = 64  # workers looked at per step of the block search

    def __init__(self, n: int, rng: np.random.Generator, online: Online, online_mask: OnlineMask,
                 pool: IdlePool | None = None) -> None:
        super().__init__(n, rng, online, online_mask, pool)
        self.order = rng.permutation(n).astype(np.int64)
        self.turn = 0  # the position in ``order`` of the next worker to ask

    def pick(self, after: int | None) -> int | None:
        n, order, pos = self.n, self.order, self.pool.pos
        for k in range(min(self.ONE_BY_ONE, n)):  # (usually the turn's own worker, or the next one)
            i = (self.turn + k) % n
            w = int(order[i])
            if pos[w] >= 0 and self.online(w):
                self.turn = (i + 1) % n
                return w
        for start in range(min(self.ONE_BY_ONE, n), n, self.BLOCK):
            idx = (self.turn + np.arange(start, min(start + self.BLOCK, n))) % n
            candidates = order[idx]
            ok = pos[candidates] >= 0
            if ok.any():
                ok[ok] = self.online_mask(candidates[ok])
            hit = np.flatnonzero(ok)
            if hit.size:
                self.turn = int((idx[hit[0]] + 1) % n)
                return int(candidates[hit[0]])
        return None

    def arrays(self) -> dict[str, np.ndarray]:
        return {"order": self.order, "turn": np.array([self.turn], np.int64)}

    def restore_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        order, turn = arrays.get("order"), arrays.get("turn")
        if (set(arrays) != {"order", "turn"} or order is None or turn is None or order.shape != (self.n,)
                or turn.shape != (1,) or not np.array_equal(np.sort(order), np.arange(self.n))
                or not 0 <= int(turn[0]) < self.n):
            raise ValueError("the checkpoint's round-robin order does not fit this run")
        self.order, self.turn = order.astype(np.int64), int(turn[0])


#: The selections of a sampled population (C < N) by name: ``AsyncStrategy(selection=...)``,
#: ``--selection``. Register a selector of your own here (a subclass of ``IdleSelector``).
SELECTORS: dict[str, type[IdleSelector]] = {UniformIdle.name: UniformIdle, RoundRobin.name: RoundRobin}


@dataclass
class PopulationOptions:
    """Who trains, and when the run starts (``AsyncStrategy``'s ``concurrency``, ``selection``,
    ``fraction_train``, ``min_train_nodes``, ``min_available_nodes``; documented there)."""

    concurrency: int | None = None
    selection: str = UniformIdle.name
    fraction_train: float = 1.0
    min_train_nodes: int = 2
    min_available_nodes: int = 1

    def slots(self, n: int) -> int:
        """C for a run of ``n`` workers: ``concurrency``, else max(min_train_nodes, ⌊fraction_train · n⌋)
        (FedAvg's count of a round's nodes), at most n."""
        if self.concurrency is not None:
            return min(self.concurrency, n)
        return min(n, max(self.min_train_nodes, int(n * self.fraction_train)))


@dataclass
class PopulationState:
    """What a checkpoint keeps of the population: its concurrency, waiting slots, and (C < N) its
    selection's name, idle pool, generator and own arrays."""

    concurrency: int = 0
    parked: int = 0
    pool: IdlePool | None = None
    rng: np.random.Generator | None = None
    selection: str = UniformIdle.name
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


class Population:
    """N workers of which at most C have a job in flight: the selector and the slots that wait.

    With C = N (the default) every worker is always busy and a freed slot stays with its worker
    (``SameWorker``); with C < N a freed slot goes to the idle, online worker that the selection
    (``SELECTORS[selection]``, uniform draws by default) picks, and when none is online the slot
    waits (``parked``) until one is.
    """

    def __init__(self, n: int, concurrency: int, seed: int, online: Online, online_mask: OnlineMask,
                 selection: str = UniformIdle.name) -> None:
        if not 1 <= concurrency:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        if selection not in SELECTORS:
            raise ValueError(f"unknown selection {selection!r}; choose one of {', '.join(SELECTORS)}")
        self.n, self.concurrency = n, min(int(concurrency), n)
        self.selection = selection
        self.parked = 0
        self.selector: SameWorker | IdleSelector = (
            SameWorker(online) if not self.sampled else
            SELECTORS[selection](n, np.random.default_rng((int(seed), 0x5E1EC7)), online, online_mask))

    @property
    def sampled(self) -> bool:
        """True when fewer workers train at a time than there are (C < N)."""
        return self.concurrency < self.n

    def next_worker(self, after: int | None) -> int | None:
        """The worker of the next job; None (a slot waits, when sampled) if none can take it now."""
        worker = self.selector.next_worker(after)
        if worker is None and self.sampled:
            self.parked += 1
        return worker

    def periods(self, clock: VirtualClock, weights: Sequence[float] | None) -> tuple[TauTable, str]:
        """C < N or an availability model, on the virtual clock: the τ table the stepsize rules read (each worker's mean time
        between deliveries, p_i = 1 / f_i) and how the manager keeps it up to date: ``average`` (the
        time so far over the worker's deliveries, started from the mean-field value of
        ``delivery_periods`` as one delivery's worth of evidence) or, for speeds that change during
        the run, ``ema`` (a moving average of the intervals, as on the wall clock). The mean-field
        value alone is exact only for many clients: with few, a slow client waits less than a fast
        one (while it is idle, the busy ones are faster), so it is where the estimate starts."""
        prior = delivery_periods(clock.delays.means()[: self.n], self.concurrency)
        changing = clock.delays.describe()["kind"] in ("drift", "switch")
        return TauTable(self.n, prior.tolist(), weights, estimated=True), "ema" if changing else "average"

    def admit_only(self, admit: Online) -> None:
        """With C < N, leave out of every later selection a worker that ``admit`` refuses (a private
        run: a client whose next update would take its ε past the budget). The selector sees it as
        offline: it is passed over, and a slot that finds no admitted idle worker waits. ``admit``
        is asked each time the worker is a candidate; it stays idle in the pool, so checkpoints and
        their checks are unchanged. With C = N (every worker always busy) the strategy keeps the
        freed slot empty itself."""
        sel = self.selector
        if not isinstance(sel, IdleSelector):
            return
        online, online_mask = sel.online, sel.online_mask
        sel.online = lambda w: online(w) and admit(w)

        def mask(workers: np.ndarray) -> np.ndarray:
            up = online_mask(workers)
            for i in np.flatnonzero(up):
                up[i] = admit(int(workers[i]))
            return up

        sel.online_mask = mask

    def take_parked(self) -> int:
        parked, self.parked = self.parked, 0
        return parked

    def idle_workers(self) -> np.ndarray:
        sel = self.selector
        return sel.idle_workers() if isinstance(sel, IdleSelector) else np.zeros(0, np.int64)

    def state(self) -> PopulationState:
        sel = self.selector
        if isinstance(sel, IdleSelector):
            return PopulationState(self.concurrency, self.parked, sel.pool, sel.rng, self.selection, sel.arrays())
        return PopulationState(self.concurrency, self.parked, selection=self.selection)

    def restore(self, state: PopulationState, idle: np.ndarray) -> None:
        """Go on from ``state``, checked: this run's C and selection, at most C slots waiting (none
        when every worker is always busy), and (C < N) an idle pool of exactly the workers with no
        job in flight (``idle``, from the books)."""
        if state.concurrency != self.concurrency:
            raise ValueError(f"the checkpoint's concurrency is {state.concurrency}, this run's {self.concurrency}")
        if state.selection != self.selection:
            raise ValueError(f"the checkpoint's selection is {state.selection!r}, this run's {self.selection!r}")
        if not 0 <= state.parked <= (self.concurrency if self.sampled else 0):
            raise ValueError(f"{state.parked} slots wait for a worker, with {self.concurrency} slots "
                             f"{'' if self.sampled else 'that never wait'}".rstrip())
        self.parked = state.parked
        sel = self.selector
        if isinstance(sel, IdleSelector):
            if state.pool is None or state.rng is None or len(state.pool.pos) != self.n:
                raise ValueError("the checkpoint's idle pool does not fit this run")
            members = np.zeros(self.n, bool)
            members[state.pool.items[: state.pool.size]] = True
            if (members != idle).any():
                raise ValueError(f"the idle pool lists {state.pool.size} workers, and {int(idle.sum())} have "
                                 "no job in flight")
            sel.pool, sel.rng = state.pool, state.rng
            sel.restore_arrays(state.arrays)
