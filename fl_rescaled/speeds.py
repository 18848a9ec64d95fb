"""Client speeds that change during a run: wrappers that scale another model's job durations.

:class:`Drift` (a factor that changes linearly or geometrically with the job's start time) and
:class:`Switch` (a factor that applies from a given time on), each for all clients or a subset.
The wrapped model is any :class:`fl_rescaled.delays.ComputeTimes`; wrappers nest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .traces import per_client, subset, summary

class _Scaled:
    """A model whose durations are multiplied by a per-client factor of the job's start time."""

    kind = ""

    def __init__(self, base) -> None:
        self.base = base
        self.num_clients = base.num_clients

    def factor(self, client: int, t: float) -> float:
        """The factor applied to a job of ``client`` that starts at time ``t``."""
        if not 0 <= client < self.num_clients:
            raise ValueError(f"client {client} is not in 0..{self.num_clients - 1}")
        if not math.isfinite(t):
            raise ValueError(f"a job's start time must be finite, got {t}")
        return self._factor(int(client), float(t))

    def mean(self, client: int) -> float:
        """Expected duration of a job of ``client`` started at time 0."""
        return self.factor(client, 0.0) * self.base.mean(client)

    def means(self) -> np.ndarray:
        return self._factors(0.0, slice(None)) * self.base.means()

    def sample(self, client: int, now: float) -> float:
        return self.factor(client, now) * self.base.sample(client, now)

    def state(self) -> dict:
        return {"kind": self.kind, "base": self.base.state()}

    def restore(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"kind", "base"} or state["kind"] != self.kind:
            raise ValueError(f"not a state of a {self.kind!r} model")
        self.base.restore(state["base"])

    def describe(self) -> dict:
        return {"kind": self.kind, **self._params(), "base": self.base.describe()}


class Drift(_Scaled):
    """Speeds that drift: a job of client i starting at time t takes f_i(t) times its base duration.

    Parameters
    ----------
    base : ComputeTimes
        The model whose durations are scaled.
    rate : float or array_like
        r_i per time unit (one number or one per client). ``mode="linear"``: f_i(t) = 1 + r_i·t;
        ``mode="geometric"``: f_i(t) = (1 + r_i)^t (r_i > −1). r > 0 slows a client down.
    mode : {"linear", "geometric"}
    min_factor, max_factor : float
        f_i is clamped to [min_factor, max_factor] (0 < min_factor ≤ 1 ≤ max_factor).
    clients, fraction, seed
        Only these clients drift (see :func:`subset`); the others keep f = 1.
    """

    kind = "drift"

    def __init__(self, base, *, rate, mode: str = "linear", min_factor: float = 1e-3,
                 max_factor: float = 1e3, clients: Sequence[int] | None = None, fraction: float | None = None,
                 seed: int = 0) -> None:
        super().__init__(base)
        if mode not in ("linear", "geometric"):
            raise ValueError(f"drift mode must be 'linear' or 'geometric', got {mode!r}")
        if not 0 < min_factor <= 1 <= max_factor < math.inf:
            raise ValueError("drift needs 0 < min_factor <= 1 <= max_factor < inf")
        low = -1.0 if mode == "geometric" else -math.inf
        rate = per_client(rate, self.num_clients, "rate", low=low)
        self._rate = np.where(subset(self.num_clients, clients=clients, fraction=fraction, seed=seed), rate, 0.0)
        self._log1p = np.log1p(self._rate)
        self._rates, self._log1ps = self._rate.tolist(), self._log1p.tolist()
        self.mode, self.min_factor, self.max_factor = mode, float(min_factor), float(max_factor)

    def _factors(self, t: float, which) -> np.ndarray:
        if self.mode == "linear":
            return np.clip(1.0 + self._rate[which] * t, self.min_factor, self.max_factor)
        return np.exp(np.clip(self._log1p[which] * t, math.log(self.min_factor), math.log(self.max_factor)))

    def _factor(self, client: int, t: float) -> float:  # (one client: plain floats are ~50× faster)
        if self.mode == "linear":
            return min(max(1.0 + self._rates[client] * t, self.min_factor), self.max_factor)
        log_f = min(max(self._log1ps[client] * t, math.log(self.min_factor)), math.log(self.max_factor))
        return math.exp(log_f)

    def _params(self) -> dict:
        return {"mode": self.mode, "rate": summary(self._rate), "min_factor": self.min_factor,
                "max_factor": self.max_factor, "clients_affected": int(np.count_nonzero(self._rate))}


class Switch(_Scaled):
    """Speeds that change once: jobs of affected clients starting at time t ≥ ``at`` take ``factor``
    times their base duration (a job starting before ``at`` keeps factor 1).

    Parameters
    ----------
    base : ComputeTimes
        The model whose durations are scaled.
    at : float or array_like
        The switch time T (one or one per client).
    factor : float or array_like
        f > 0 after T (2 halves the speed, 0.5 doubles it).
    clients, fraction, seed
        Only these clients switch (see :func:`subset`).
    """

    kind = "switch"

    def __init__(self, base, *, at, factor, clients: Sequence[int] | None = None,
                 fraction: float | None = None, seed: int = 0) -> None:
        super().__init__(base)
        self._at = per_client(at, self.num_clients, "at", low=-math.inf)
        self._after = per_client(factor, self.num_clients, "factor")
        self._mask = subset(self.num_clients, clients=clients, fraction=fraction, seed=seed)
        self._ats, self._afters, self._masks = self._at.tolist(), self._after.tolist(), self._mask.tolist()

    def _factors(self, t: float, which) -> np.ndarray:
        return np.where(self._mask[which] & (t >= self._at[which]), self._after[which], 1.0)

    def _factor(self, client: int, t: float) -> float:
        return self._afters[client] if self._masks[client] and t >= self._ats[client] else 1.0

    def _params(self) -> dict:
        return {"at": summary(self._at), "factor": summary(self._after),
                "clients_affected": int(np.count_nonzero(self._mask))}


