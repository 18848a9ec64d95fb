"""When each client of a simulated population is online: per-client on/off intervals.

A model (:class:`Availability`) answers, for one client and a virtual time t, whether the client is
online and when it next comes online or goes offline, in O(1) (:class:`Always`, :class:`Daily`) or
O(log k) for a client with k intervals (:class:`TraceAvailability`), and the same for many clients at
once with numpy. Online intervals are half-open, [start, end): a client is online at ``start`` and
offline at ``end``. :func:`availability` builds a model by name.
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from .traces import per_client, read_availability, summary

KINDS = ("always", "daily", "trace")


@runtime_checkable
class Availability(Protocol):
    """Per-client online intervals on a virtual clock."""

    num_clients: int

    def online(self, client: int, t: float) -> bool: ...

    def online_mask(self, clients: np.ndarray, t: float) -> np.ndarray: ...

    def next_on(self, client: int, t: float) -> float: ...

    def next_off(self, client: int, t: float) -> float: ...

    def next_on_many(self, clients: np.ndarray, t: float) -> np.ndarray: ...

    def state(self) -> dict: ...

    def restore(self, state: dict) -> None: ...

    def describe(self) -> dict: ...


class _Base:
    """Checks shared by the models. They are fixed during a run: the state only identifies them."""

    kind = ""

    def __init__(self, num_clients: int) -> None:
        if not 0 < num_clients <= 10**8:
            raise ValueError(f"num_clients must be in 1..10^8, got {num_clients}")
        self.num_clients = int(num_clients)

    def _check(self, client: int, t: float) -> None:
        if not 0 <= client < self.num_clients:
            raise ValueError(f"client {client} is not in 0..{self.num_clients - 1}")
        if not math.isfinite(t):
            raise ValueError(f"time must be finite, got {t}")

    def _ids(self, clients, t: float) -> np.ndarray:
        if not math.isfinite(t):
            raise ValueError(f"time must be finite, got {t}")
        ids = np.asarray(clients, dtype=np.int64)
        if ids.ndim != 1 or ids.size and (ids.min() < 0 or ids.max() >= self.num_clients):
            raise ValueError(f"clients must be a 1-d array of ids in 0..{self.num_clients - 1}")
        return ids

    def state(self) -> dict:
        """JSON-able: which model this is (nothing in it changes while it is used)."""
        return {"kind": self.kind, "num_clients": self.num_clients}

    def restore(self, state: dict) -> None:
        """Check that ``state`` is this model's :meth:`state`."""
        if state != self.state():
            raise ValueError(f"not a state of this {self.kind!r} availability model ({self.state()})")

    def describe(self) -> dict:
        return {"kind": self.kind, "num_clients": self.num_clients, **self._params()}

    def _params(self) -> dict:
        return {}


class Always(_Base):
    """Every client is online all the time."""

    kind = "always"

    def online(self, client: int, t: float) -> bool:
        self._check(client, t)
        return True

    def online_mask(self, clients: np.ndarray, t: float) -> np.ndarray:
        return np.ones(self._ids(clients, t).size, dtype=bool)

    def next_on(self, client: int, t: float) -> float:
        self._check(client, t)
        return float(t)

    def next_off(self, client: int, t: float) -> float:
        self._check(client, t)
        return math.inf

    def next_on_many(self, clients: np.ndarray, t: float) -> np.ndarray:
        return np.full(self._ids(clients, t).size, float(t))


class Daily(_Base):
    """A cycle of period P_i with client i online a fraction d_i of it, from a random phase φ_i.

    Client i is online on [j·P_i − φ_i, j·P_i − φ_i + d_i·P_i) for every integer j, i.e. iff
    ((t + φ_i) mod P_i) < d_i·P_i; over a long run it is online a fraction d_i of the time.

    Parameters
    ----------
    num_clients : int
    period : float or array_like
        P > 0 (one number or one per client).
    fraction : float or array_like
        d in [0, 1]: 0 is never online, 1 always.
    seed : int
        Draws φ_i ~ U[0, P_i) independently (when ``phases`` is not given).
    phases : array_like, optional
        φ_i explicitly, in [0, P_i).
    """

    kind = "daily"

    def __init__(self, num_clients: int, *, period=24.0, fraction=0.5, seed: int = 0, phases=None) -> None:
        super().__init__(num_clients)
        n = self.num_clients
        self._period = per_client(period, n, "period")
        self._fraction = per_client(fraction, n, "fraction", strict=False, high=1.0)
        if phases is None:
            phases = np.random.default_rng((seed, 0xDA11)).uniform(0.0, self._period)
        self._phase = per_client(phases, n, "phases", strict=False)
        if np.any(self._phase >= self._period):
            raise ValueError("phases must be below the period")
        self._on = self._fraction * self._period
        self._scalars = list(zip(self._period.tolist(), self._phase.tolist(), self._on.tolist()))
        self.seed = int(seed)

    def _cycle(self, client: int, t: float) -> tuple[bool, float, float]:
        """(online?, start, end) of the first cycle ending after t: the one holding t, or the next."""
        p, phi, on = self._scalars[client]
        j0 = math.floor((t + phi) / p)
        for j in (j0 - 1, j0, j0 + 1, j0 + 2):  # j0 ± 1: ⌊(t + φ)/P⌋ may round across a cycle boundary
            start = j * p - phi
            if t < start + on:
                break
        return start <= t, start, start + on

    def online(self, client: int, t: float) -> bool:
        self._check(client, t)
        d = self._fraction[client]
        return d >= 1 or (d > 0 and self._cycle(client, t)[0])

    def next_on(self, client: int, t: float) -> float:
        self._check(client, t)
        d = self._fraction[client]
        if d <= 0 or d >= 1:
            return math.inf if d <= 0 else float(t)
        on, start, _ = self._cycle(client, t)
        return float(t) if on else start

    def next_off(self, client: int, t: float) -> float:
        self._check(client, t)
        d = self._fraction[client]
        if d <= 0 or d >= 1:
            return float(t) if d <= 0 else math.inf
        on, _, end = self._cycle(client, t)
        if not on:
            return float(t)
        for _ in range(3):  # float rounding may let the next cycle start at or before this one's end
            on, _, later = self._cycle(client, end)
            if not on:
                break
            end = later
        return end

    def _cycles_many(self, ids: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised :meth:`_cycle`: (online, start) per client, the same floating-point operations."""
        p, phi, on = self._period[ids], self._phase[ids], self._on[ids]
        start = (np.floor((t + phi) / p) + np.arange(-1, 3)[:, None]) * p - phi
        k = (t < start + on).argmax(axis=0)
        start = start[k, np.arange(ids.size)]
        return (start <= t) & (t < start + on), start

    def online_mask(self, clients: np.ndarray, t: float) -> np.ndarray:
        ids = self._ids(clients, t)
        d = self._fraction[ids]
        return (d >= 1) | ((d > 0) & self._cycles_many(ids, t)[0])

    def next_on_many(self, clients: np.ndarray, t: float) -> np.ndarray:
        ids = self._ids(clients, t)
        d = self._fraction[ids]
        on, start = self._cycles_many(ids, t)
        return np.where((d >= 1) | on & (d > 0), float(t), np.where(d <= 0, math.inf, start))

    def _params(self) -> dict:
        return {"period": summary(self._period), "fraction": summary(self._fraction), "seed": self.seed}


class TraceAvailability(_Base):
    """Online intervals read from a trace: client i is online on each of its [start, end).

    Parameters
    ----------
    starts, ends, offsets : array_like
        Client i's intervals are ``starts[offsets[i]:offsets[i + 1]]`` (and the same of ``ends``),
        sorted, non-overlapping and not touching, as :func:`fl_rescaled.traces.read_availability`
        returns them. A client without intervals is never online.
    """

    kind = "trace"

    def __init__(self, starts, ends, offsets, *, source: str | None = None) -> None:
        offsets = np.asarray(offsets, dtype=np.int64)
        super().__init__(offsets.size - 1)
        m = int(offsets[-1])
        starts = per_client(starts, m, "starts", low=-math.inf)
        ends = per_client(ends, m, "ends", low=-math.inf)
        if offsets[0] != 0 or np.any(np.diff(offsets) < 0):
            raise ValueError("offsets must rise from 0 to the number of intervals")
        first = np.zeros(m, dtype=bool)
        first[offsets[:-1][offsets[:-1] < m]] = True
        if np.any(starts >= ends) or np.any(~first[1:] & (starts[1:] <= ends[:-1])):
            raise ValueError("each client's intervals must have start < end, be sorted and neither overlap nor touch")
        # Sentinels past the end: starts[m] = inf (no later interval), ends[-1] = -inf (none before).
        self._starts, self._ends = np.append(starts, math.inf), np.append(ends, -math.inf)
        self._offsets = offsets
        self._lists = self._starts.tolist(), self._ends.tolist(), offsets.tolist()  # (faster to index one by one)
        self.source = source

    @classmethod
    def from_lists(cls, intervals: Sequence[Sequence[tuple[float, float]]]) -> TraceAvailability:
        """One list of (start, end) per client, already sorted and disjoint."""
        pairs = [np.asarray(v, dtype=np.float64).reshape(-1, 2) for v in intervals]
        both = np.concatenate(pairs) if pairs else np.zeros((0, 2))
        return cls(both[:, 0], both[:, 1], np.concatenate(([0], np.cumsum([len(p) for p in pairs]))))

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, num_clients: int | None = None) -> TraceAvailability:
        """A trace read by :func:`fl_rescaled.traces.read_availability` (CSV or JSON)."""
        return cls(*read_availability(path, num_clients=num_clients), source=str(path))

    def _find(self, client: int, t: float) -> tuple[int, bool]:
        """(index of the client's first interval starting after t, online at t?)."""
        self._check(client, t)
        starts, ends, offsets = self._lists
        k = bisect.bisect_right(starts, t, offsets[client], offsets[client + 1])
        return k, k > offsets[client] and t < ends[k - 1]

    def online(self, client: int, t: float) -> bool:
        return self._find(client, t)[1]

    def next_on(self, client: int, t: float) -> float:
        k, on = self._find(client, t)
        return float(t) if on else (self._lists[0][k] if k < self._lists[2][client + 1] else math.inf)

    def next_off(self, client: int, t: float) -> float:
        k, on = self._find(client, t)
        return self._lists[1][k - 1] if on else float(t)

    def _find_many(self, ids: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised :meth:`_find`: a bisection in every client's segment at once."""
        first, hi = self._offsets[ids], self._offsets[ids + 1]
        lo = first.copy()
        while True:
            active = lo < hi
            if not active.any():
                break
            mid = (lo + hi) // 2
            right = active & (self._starts[mid] <= t)
            lo, hi = np.where(right, mid + 1, lo), np.where(active & ~right, mid, hi)
        return lo, (lo > first) & (t < self._ends[lo - 1])

    def online_mask(self, clients: np.ndarray, t: float) -> np.ndarray:
        return self._find_many(self._ids(clients, t), t)[1]

    def next_on_many(self, clients: np.ndarray, t: float) -> np.ndarray:
        ids = self._ids(clients, t)
        k, on = self._find_many(ids, t)
        return np.where(on, float(t), np.where(k < self._offsets[ids + 1], self._starts[k], math.inf))

    def _params(self) -> dict:
        return {"intervals": int(self._offsets[-1]), "source": self.source}


def availability(kind: str, num_clients: int | None = None, *, seed: int = 0, period=24.0, fraction=0.5,
                 phases=None, trace: str | os.PathLike | None = None) -> Availability:
    """An availability model by name.

    Parameters
    ----------
    kind : {"always", "daily", "trace"}
    num_clients : int, optional
        N (required except for ``"trace"``, where it defaults to the file's).
    seed, period, fraction, phases
        :class:`Daily`'s.
    trace : path, optional
        The availability trace for ``kind="trace"`` (CSV or JSON, see :mod:`fl_rescaled.traces`).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown availability model {kind!r}; choose one of {KINDS}")
    if (kind == "trace") != (trace is not None):
        raise ValueError("kind='trace' takes trace= (a file); the other kinds take none")
    if kind == "trace":
        return TraceAvailability.from_file(trace, num_clients=num_clients)
    if num_clients is None:
        raise ValueError(f"availability {kind!r} needs num_clients")
    if kind == "always":
        return Always(num_clients)
    return Daily(num_clients, period=period, fraction=fraction, seed=seed, phases=phases)
