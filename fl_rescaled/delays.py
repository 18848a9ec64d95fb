"""Per-client compute-time models for a simulated population of up to ~10⁵ clients.

A model gives the duration of each client's next job (:class:`ComputeTimes`): fixed τ_i,
exponential, lognormal or Pareto draws of mean τ_i, or measured durations replayed from a trace;
:mod:`fl_rescaled.speeds` wraps any of them so that a client's speed changes during a run.
Client i draws from its own generator, ``np.random.default_rng((seed, 0xDE1A, i))`` as in
:class:`fl_rescaled.clock.DelayModel` (``fixed`` and ``exponential`` reproduce it bit for bit),
created on the client's first draw. :func:`compute_times` builds a model by name and
:func:`tau_profile` per-client mean times for a large population. docs/population.md has the formulas.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from .codec import pcg64_state
from .speeds import Drift, Switch
from .traces import per_client, read_durations, summary

#: Tag in every client generator's seed, shared with ``fl_rescaled.clock.DelayModel``.
SEED_TAG = 0xDE1A
BASE_KINDS = ("fixed", "exponential", "lognormal", "pareto", "trace")
TAU_PROFILES = ("powers", "lognormal", "uniform", "constant")


@runtime_checkable
class ComputeTimes(Protocol):
    """Per-client job durations on a virtual clock."""

    num_clients: int

    def mean(self, client: int) -> float: ...

    def means(self) -> np.ndarray: ...

    def sample(self, client: int, now: float) -> float: ...

    def state(self) -> dict: ...

    def restore(self, state: dict) -> None: ...

    def describe(self) -> dict: ...


class _Model:
    """Per-client mean times, lazily created per-client generators, and their state (parameters:
    see :class:`Fixed`)."""

    kind = ""
    _extra_keys: tuple[str, ...] = ()

    def __init__(self, taus, *, seed: int = 0) -> None:
        taus = np.asarray(taus, dtype=np.float64)
        if taus.ndim != 1 or taus.size == 0:
            raise ValueError("taus must be a non-empty list of per-client mean times")
        self._taus = per_client(taus, taus.size, "taus")
        self.num_clients = int(taus.size)
        if int(seed) < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.seed = int(seed)
        self._rngs: dict[int, np.random.Generator] = {}
        self._saved: dict[int, dict] = {}  # generator states restored, applied on the client's next draw

    def _check(self, client: int) -> None:
        if not 0 <= client < self.num_clients:
            raise ValueError(f"client {client} is not in 0..{self.num_clients - 1}")

    def _rng(self, client: int) -> np.random.Generator:
        rng = self._rngs.get(client)
        if rng is None:
            self._check(client)
            rng = self._rngs[client] = np.random.default_rng((self.seed, SEED_TAG, client))
            if client in self._saved:  # restored but not drawn from since
                rng.bit_generator.state = self._saved.pop(client)
        return rng

    def mean(self, client: int) -> float:
        """Expected duration of one job of ``client``."""
        self._check(client)
        return float(self._taus[client])

    def means(self) -> np.ndarray:
        """Every client's expected job duration (a new float64 array)."""
        return np.array(self._taus, dtype=np.float64)

    def state(self) -> dict:
        """JSON-able state: the generators created so far (by client id) and model-specific parts."""
        return {"kind": self.kind, "num_clients": self.num_clients, "seed": self.seed,
                "rngs": {str(i): pcg64_state(bits, f"state['rngs']['{i}']") for i, bits in sorted(
                    {**self._saved, **{i: rng.bit_generator.state for i, rng in self._rngs.items()}}.items())},
                **self._extra_state()}

    def restore(self, state: dict) -> None:
        """Go back to a :meth:`state` of a model built with the same settings."""
        want = {"kind": self.kind, "num_clients": self.num_clients, "seed": self.seed}
        keys = {"kind", "num_clients", "seed", "rngs", *self._extra_keys}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(f"not a state of a {self.kind!r} model (keys {sorted(keys)})")
        for key, value in want.items():
            if state[key] != value or type(state[key]) is not type(value):
                raise ValueError(f"the state has {key}={state[key]!r}, this model has {value!r}")
        saved = {client: pcg64_state(bits, f"state['rngs']['{client}']") for client, bits in self._ids(state["rngs"], "rngs").items()}
        self._restore_extra(state)
        self._rngs, self._saved = {}, saved

    def _ids(self, mapping, name: str) -> dict:
        if not isinstance(mapping, dict):
            raise ValueError(f"state[{name!r}] must be an object keyed by client id")
        out = {}
        for key, value in mapping.items():
            ok = isinstance(key, str) and key.isascii() and key.isdigit() and str(int(key)) == key
            if not ok or int(key) >= self.num_clients:
                raise ValueError(f"state[{name!r}] has key {str(key)[:20]!r}, not a client id in "
                                 f"0..{self.num_clients - 1}")
            out[int(key)] = value
        return out

    def describe(self) -> dict:
        """Settings for a report: kind, number of clients, seed, τ (summarised) and parameters."""
        return {"kind": self.kind, "num_clients": self.num_clients, "seed": self.seed, "tau": summary(self._taus),
                **self._params()}

    def _extra_state(self) -> dict:
        return {}

    def _restore_extra(self, state: dict) -> None:
        pass

    def _params(self) -> dict:
        return {}


class Fixed(_Model):
    """Every job of client i takes exactly τ_i (no randomness; ``DelayModel(kind="fixed")``).

    Parameters
    ----------
    taus : array_like
        τ_i, the mean duration of client i's jobs (N positive finite numbers).
    seed : int
        Non-negative; client i draws from ``np.random.default_rng((seed, 0xDE1A, i))`` (the random
        models; ``fixed`` draws nothing).
    """

    kind = "fixed"

    def sample(self, client: int, now: float = 0.0) -> float:
        self._check(client)
        return float(self._taus[client])


class Exponential(_Model):
    """Independent Exp(mean τ_i) durations, draw for draw those of ``DelayModel(kind="exponential")``.

    Parameters
    ----------
    taus, seed
        As for every model (:class:`Fixed`).
    """

    kind = "exponential"

    def sample(self, client: int, now: float = 0.0) -> float:
        return float(self._rng(client).exponential(self._taus[client]))


class LogNormal(_Model):
    """Lognormal durations of mean τ_i: exp(μ_i + σ Z), Z ~ N(0, 1), with μ_i = ln τ_i − σ²/2.

    The coefficient of variation is sqrt(exp(σ²) − 1) and the median τ_i·exp(−σ²/2).

    Parameters
    ----------
    taus, seed
        As for every model (:class:`Fixed`).
    sigma : float or array_like
        σ in [0, 10], one number or one per client (0: exactly τ_i).
    """

    kind = "lognormal"

    def __init__(self, taus, *, sigma=0.5, seed: int = 0) -> None:
        super().__init__(taus, seed=seed)
        self._sigma = per_client(sigma, self.num_clients, "sigma", strict=False, high=10.0)
        self._mu = np.log(self._taus) - self._sigma**2 / 2

    def sample(self, client: int, now: float = 0.0) -> float:
        return float(self._rng(client).lognormal(self._mu[client], self._sigma[client]))

    def _params(self) -> dict:
        return {"sigma": summary(self._sigma)}


class Pareto(_Model):
    """Heavy-tailed durations of mean τ_i: a Pareto (type I) law of shape α > 1 and minimum
    x_i = τ_i (α − 1)/α, i.e. x_i·(1 + L) with L ~ Lomax(α) (numpy's ``pareto``).

    Every duration is at least x_i; P(duration > s) = (x_i/s)^α. The variance τ_i²/(α(α − 2)) is
    finite only for α > 2.

    Parameters
    ----------
    taus, seed
        As for every model (:class:`Fixed`).
    alpha : float or array_like
        α > 1, one number or one per client.
    """

    kind = "pareto"

    def __init__(self, taus, *, alpha=3.0, seed: int = 0) -> None:
        super().__init__(taus, seed=seed)
        self._alpha = per_client(alpha, self.num_clients, "alpha", low=1.0)
        self._xmin = self._taus * (self._alpha - 1) / self._alpha

    def sample(self, client: int, now: float = 0.0) -> float:
        return float(self._xmin[client] * (1.0 + self._rng(client).pareto(self._alpha[client])))

    def _params(self) -> dict:
        return {"alpha": summary(self._alpha)}


class TraceTimes(_Model):
    """Measured durations replayed in order, client by client; a client that has used all its
    durations starts again from its first (the list cycles). Its mean is its list's average.

    Parameters
    ----------
    values, offsets : array_like
        Client i's durations are ``values[offsets[i]:offsets[i + 1]]`` (at least one each, positive
        and finite), as :func:`fl_rescaled.traces.read_durations` returns them.
    """

    kind = "trace"
    _extra_keys = ("positions",)

    def __init__(self, values, offsets, *, source: str | None = None) -> None:
        values, offsets = np.asarray(values, dtype=np.float64), np.asarray(offsets, dtype=np.int64)
        if offsets.ndim != 1 or offsets.size < 2 or offsets[0] != 0 or offsets[-1] != values.size \
                or np.any(np.diff(offsets) < 1):
            raise ValueError("offsets must rise from 0 to len(values), each client having a duration")
        per_client(values, values.size, "durations")
        lengths = np.diff(offsets)
        super().__init__(np.add.reduceat(values, offsets[:-1]) / lengths, seed=0)
        self._values, self._offsets, self._lengths = values, offsets, lengths
        self._pos = np.zeros(self.num_clients, dtype=np.int64)
        self.source = source

    @classmethod
    def from_lists(cls, durations: Sequence[Sequence[float]]) -> TraceTimes:
        """A trace from one list of durations per client."""
        lengths = [len(d) for d in durations]
        flat = np.concatenate([np.asarray(d, dtype=np.float64).ravel() for d in durations]) if durations else []
        return cls(flat, np.concatenate(([0], np.cumsum(lengths))))

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, num_clients: int | None = None) -> TraceTimes:
        """A trace read by :func:`fl_rescaled.traces.read_durations` (CSV or JSON)."""
        return cls(*read_durations(path, num_clients=num_clients), source=str(path))

    def sample(self, client: int, now: float = 0.0) -> float:
        self._check(client)
        k = self._pos[client]
        self._pos[client] = k + 1
        return float(self._values[self._offsets[client] + k % self._lengths[client]])

    def _extra_state(self) -> dict:
        return {"positions": {str(i): int(self._pos[i]) for i in np.flatnonzero(self._pos)}}

    def _restore_extra(self, state: dict) -> None:
        pos = np.zeros(self.num_clients, dtype=np.int64)
        for client, k in self._ids(state["positions"], "positions").items():
            if type(k) is not int or not 0 <= k < 2**62:
                raise ValueError(f"state['positions']['{client}'] must be a non-negative integer")
            pos[client] = k
        self._pos = pos

    def _params(self) -> dict:
        return {"jobs": summary(self._lengths.astype(np.float64)), "source": self.source}


def compute_times(kind: str, taus=None, *, seed: int = 0, sigma=0.5, alpha=3.0,
                  trace: str | os.PathLike | None = None, drift: dict | None = None,
                  switch: dict | None = None) -> ComputeTimes:
    """A compute-time model by name.

    Parameters
    ----------
    kind : {"fixed", "exponential", "lognormal", "pareto", "trace"}
    taus : array_like, optional
        Per-client mean times τ_i (not for ``"trace"``, whose means come from the file).
    seed : int
        Seeds the per-client generators and the choice of clients for ``fraction=``.
    sigma : float or array_like
        Lognormal spread σ.
    alpha : float or array_like
        Pareto shape α > 1.
    trace : path, optional
        The compute-time trace for ``kind="trace"`` (CSV or JSON, see :mod:`fl_rescaled.traces`).
    drift, switch : dict, optional
        Keyword arguments of :class:`Drift` / :class:`Switch` (without ``base``); the model is
        wrapped in a drift first, then in a switch.
    """
    if kind not in BASE_KINDS:
        raise ValueError(f"unknown compute-time model {kind!r}; choose one of {BASE_KINDS}")
    if (kind == "trace") != (trace is not None) or (kind == "trace") == (taus is not None):
        raise ValueError("kind='trace' takes trace= and no taus; the other kinds take taus and no trace")
    model: ComputeTimes
    if kind == "trace":
        model = TraceTimes.from_file(trace)
    elif kind == "lognormal":
        model = LogNormal(taus, sigma=sigma, seed=seed)
    elif kind == "pareto":
        model = Pareto(taus, alpha=alpha, seed=seed)
    else:
        model = (Fixed if kind == "fixed" else Exponential)(taus, seed=seed)
    for wrapper, options in ((Drift, drift), (Switch, switch)):
        if options is not None:
            try:
                model = wrapper(model, seed=seed, **options)
            except TypeError as e:
                raise ValueError(f"{wrapper.kind} options: {e}") from None
    return model


def tau_profile(n: int, kind: str = "powers", *, seed: int = 0, scale: float = 1.0, spread: float = 1.0,
                low: float = 1.0, high: float = 16.0) -> np.ndarray:
    """Per-client mean compute times τ_0..τ_{n−1} (float64) for a large population.

    Parameters
    ----------
    n : int
        Number of clients.
    kind : {"powers", "lognormal", "uniform", "constant"}
        ``powers``: scale·2^((i // 2) mod 5), i.e. the project's 1, 1, 2, 2, 4, 4, 8, 8, 16, 16
        repeated; ``lognormal``: scale·exp(spread·Z_i − spread²/2), independent, population mean
        ``scale``; ``uniform``: independent U(low, high); ``constant``: ``scale`` for all.
    seed : int
        Seeds the random profiles.
    """
    if not 0 < n <= 10**8:
        raise ValueError(f"n must be in 1..10^8, got {n}")
    if not (scale > 0 and math.isfinite(scale) and 0 <= spread <= 10 and 0 < low <= high < math.inf):
        raise ValueError("tau_profile needs scale > 0, 0 <= spread <= 10 and 0 < low <= high < inf")
    rng = np.random.default_rng((seed, 0x7A0))
    if kind == "powers":
        taus = scale * 2.0 ** ((np.arange(n) // 2) % 5)
    elif kind == "lognormal":
        taus = scale * np.exp(spread * rng.standard_normal(n) - spread**2 / 2)
    elif kind == "uniform":
        taus = rng.uniform(low, high, n)
    elif kind == "constant":
        taus = np.full(n, float(scale))
    else:
        raise ValueError(f"unknown tau profile {kind!r}; choose one of {TAU_PROFILES}")
    return per_client(taus, n, "taus")
