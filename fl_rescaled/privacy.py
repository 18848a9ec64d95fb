"""Differential privacy of a run: the options, the Gaussian noise, and the per-client accountant.

The mechanism (``strategies/dp.py`` wraps any asynchronous strategy in it, ``docs/privacy.md``
derives it): every client update is clipped to L2 norm ``clipping_norm`` = C (a fixed ``clip``
bound, ``fl_rescaled.bounds``), and every aggregate the server applies gets Gaussian noise of
standard deviation σ = ``noise_multiplier`` × C, added to the sum of the clipped updates it holds
before the step (and before FedBuff divides by K). One application is one **release**; a client
whose updates enter a release m times has sensitivity m·C in it, so the release is, for that client,
a Gaussian mechanism of noise multiplier z / m.

The accountant composes, per client, the releases it entered (``PrivacyState.counts``) with
Google's ``dp-accounting`` (RDP accountant, Mironov 2017; the optional extra ``[dp]``). No
amplification by sampling is claimed: which client delivers next is decided by the clients' speeds
and availability, not by a random draw the server makes, so each release counts in full. That is
the user-level guarantee under add/remove of one client's whole data set, with the schedule (who
delivers when) public.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: The RDP orders the accountant evaluates (dp-accounting's default set, extended to large orders
#: for small ε).
ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [128, 256, 512, 1024])


def default_delta(n: int) -> float:
    """δ when none is given: 1 / N^1.1 for N clients (below 1/N, as user-level DP asks), at most 1e-5."""
    return min(1e-5, 1.0 / max(1, n) ** 1.1)


@dataclass(frozen=True)
class PrivacyOptions:
    """The DP options (``AsyncDPFixedClipping``'s ``noise_multiplier``, ``clipping_norm``, ``delta``,
    ``target_epsilon``, ``seed``; documented there)."""

    noise_multiplier: float
    clipping_norm: float
    delta: float | None = None
    target_epsilon: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        z, c = self.noise_multiplier, self.clipping_norm
        if isinstance(z, bool) or not (isinstance(z, (int, float)) and 0 <= z < math.inf):
            raise ValueError(f"noise_multiplier must be a finite number ≥ 0, got {z!r}")
        if isinstance(c, bool) or not (isinstance(c, (int, float)) and 0 < c < math.inf):
            raise ValueError(f"clipping_norm must be positive and finite, got {c!r}")
        if self.delta is not None and not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta!r}")
        if self.target_epsilon is not None:
            if not 0 < self.target_epsilon < math.inf:
                raise ValueError(f"target_epsilon must be positive and finite, got {self.target_epsilon!r}")
            if z == 0:
                raise ValueError("target_epsilon needs noise: with noise_multiplier 0 every ε is infinite")

    @property
    def sigma(self) -> float:
        """The noise's standard deviation per coordinate: z × C."""
        return self.noise_multiplier * self.clipping_norm

    def delta_for(self, n: int) -> float:
        return default_delta(n) if self.delta is None else self.delta


def _require() -> Any:
    try:
        import dp_accounting  # noqa: PLC0415 - optional: the [dp] extra
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("differential privacy needs Google's dp-accounting: pip install 'fl-rescaled[dp]'") from exc
    return dp_accounting


def check_available() -> None:
    """Raise ImportError (naming the extra) when ``dp-accounting`` is not installed."""
    _require()


def event_of(counts: dict[int, int], z: float) -> Any:
    """The dp-accounting event of one client's releases: ``counts[m]`` releases that held its update
    m times, each a Gaussian mechanism of noise multiplier z / m, composed (no sampling)."""
    dpa = _require()
    parts = [dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z / m), k) for m, k in sorted(counts.items()) if k]
    return dpa.ComposedDpEvent(parts)


@functools.lru_cache(maxsize=4096)
def _epsilon(key: tuple[tuple[int, int], ...], z: float, delta: float) -> float:
    if not key:
        return 0.0
    if z == 0:
        return math.inf
    dpa = _require()
    accountant = dpa.rdp.RdpAccountant(list(ORDERS))
    accountant.compose(event_of(dict(key), z))
    return float(accountant.get_epsilon(delta))


def epsilon(counts: dict[int, int], z: float, delta: float) -> float:
    """ε at ``delta`` of one client's releases (``event_of``), by dp-accounting's RDP accountant."""
    return _epsilon(tuple(sorted((int(m), int(k)) for m, k in counts.items() if k)), float(z), float(delta))


@dataclass
class PrivacyState:
    """The accountant's state and the noise's generator, part of every checkpoint.

    ``counts[i]``: client i's releases by multiplicity (``{"1": k}``: k releases that held one update
    of it); ``pending``: the clients whose accepted updates the strategy holds but has not applied (a
    FedBuff buffer); ``inflight[i]``: client i's jobs sent and not yet ended; ``excluded[i]``: no
    longer selected (its budget would be exceeded); ``releases``: aggregates applied with noise."""

    counts: list[dict[str, int]] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    inflight: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    excluded: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    releases: int = 0
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    @classmethod
    def fresh(cls, n: int, seed: int | None) -> PrivacyState:
        """No release yet for ``n`` clients; the noise seeded by ``seed`` (None: fresh OS entropy)."""
        bits = np.random.PCG64(np.random.SeedSequence(None if seed is None else (int(seed), 0xD1FF)))
        return cls([{} for _ in range(n)], [], np.zeros(n, np.int64), np.zeros(n, bool), 0, np.random.Generator(bits))

    def check(self) -> None:
        n = len(self.counts)
        if self.inflight.shape != (n,) or self.excluded.shape != (n,) or self.excluded.dtype != bool:
            raise ValueError("privacy: one in-flight count and one exclusion flag per client")
        if (self.inflight < 0).any() or self.releases < 0 or any(not 0 <= w < n for w in self.pending):
            raise ValueError("privacy: negative counts or pending updates of unknown clients")
        for c in self.counts:
            if any(not k.isdigit() or int(k) < 1 or v < 0 for k, v in c.items()):
                raise ValueError("privacy: a client's releases must be counted by multiplicity ≥ 1, not negative")
        if self.releases < max((sum(c.values()) for c in self.counts), default=0):
            raise ValueError("privacy: a client entered more releases than were made")

    def of(self, worker: int) -> dict[int, int]:
        return {int(m): int(k) for m, k in self.counts[worker].items()}

    def contributions(self) -> list[int]:
        """Per client: how many of its updates entered an applied aggregate."""
        return [sum(int(m) * int(k) for m, k in c.items()) for c in self.counts]

    def epsilons(self, z: float, delta: float) -> list[float]:
        return [epsilon(self.of(w), z, delta) for w in range(len(self.counts))]

    def spent_if(self, worker: int, more: int) -> dict[int, int]:
        """``worker``'s releases in the worst case if ``more`` updates of it are added to those it has
        pending and in flight: all of them in one release (m of its updates in one release cost more
        than m releases of one: the RDP of a Gaussian grows with m², not m). What the budget must
        allow before a job is sent."""
        counts = self.of(worker)
        m = self.pending.count(worker) + int(self.inflight[worker]) + more
        if m:
            counts[m] = counts.get(m, 0) + 1
        return counts

    def release(self, update: np.ndarray, sigma: float) -> np.ndarray:
        """The pending updates are released as ``update`` + N(0, σ²) per coordinate (a new array, in
        the update's float type); each pending client's releases are counted by multiplicity."""
        self.releases += 1
        for w in set(self.pending):
            m = str(self.pending.count(w))
            self.counts[w][m] = self.counts[w].get(m, 0) + 1
        self.pending.clear()
        if sigma == 0:
            return update.copy()
        dtype = update.dtype if update.dtype in (np.float32, np.float64) else np.dtype(np.float64)
        noise = self.rng.standard_normal(update.shape, dtype=dtype)
        noise *= dtype.type(sigma)
        noise += update
        return noise.astype(update.dtype, copy=False)

    def report(self, z: float, delta: float) -> dict[str, Any]:
        """The JSON ``"dp"`` object's counts and ε (per client, in client order), their maximum and mean."""
        eps = self.epsilons(z, delta)
        return {"contributions": self.contributions(), "epsilon": eps,
                "max_epsilon": max(eps, default=0.0), "mean_epsilon": float(np.mean(eps)) if eps else 0.0,
                "releases": self.releases, "excluded": np.flatnonzero(self.excluded).tolist()}


# ------------------------------------------------------------------------------------------------ adaptive clipping
#: The default noise on the released count of "norm ≤ C" bits: σ_b = ``BIT_STDDEV_FACTOR`` × z, so
#: the update's own noise multiplier is z_Δ = z / √(1 − 1/(2 · 1.2)²) ≈ 1.10 z (10% more noise on the
#: update buys the clipping norm's estimate).
BIT_STDDEV_FACTOR = 1.2


def update_noise_multiplier(z: float, bit_stddev: float) -> float:
    """z_Δ, the noise multiplier the update gets when its release also carries the noisy clipped
    count, so that the two together cost what one Gaussian of noise multiplier z does:
    z_Δ = (z⁻² − (2 σ_b)⁻²)^(−1/2) (Andrew et al. 2021, Theorem 1). The count sums the centred bits
    b − ½ (sensitivity ½, noise σ_b: noise multiplier 2σ_b), the update sensitivity C (noise z_Δ C);
    the RDP of the pair at order α is α/(2 z_Δ²) + α/(2 (2σ_b)²) = α/(2 z²). Needs 2σ_b > z; z = 0
    (no noise) gives 0."""
    if z == 0:
        return 0.0
    if not 2 * bit_stddev > z:
        raise ValueError(f"the clipped count's noise σ_b = {bit_stddev:g} is too small for noise_multiplier "
                         f"{z:g}: it needs 2 σ_b > z (raise clipped_count_stddev)")
    return (z ** -2 - (2 * bit_stddev) ** -2) ** -0.5


def clip_norm_next(clip: float, noisy_fraction: float, quantile: float, lr: float) -> float:
    """The next clipping norm after a release: C · exp(−η (b̃ − q)), b̃ the release's noisy fraction
    of updates with norm ≤ C (Andrew et al.'s geometric update)."""
    return clip * math.exp(-lr * (noisy_fraction - quantile))


@dataclass
class AdaptiveClipping:
    """The adaptive clipping norm's state, part of every checkpoint: the current norm C (every update
    that arrives is clipped to it; it changes only at a release) and the bits "‖g‖ ≤ C" of the
    updates pending, in the order of ``PrivacyState.pending``."""

    clip: float = 1.0
    bits: list[int] = field(default_factory=list)

    def check(self) -> None:
        if not 0 < self.clip < math.inf:
            raise ValueError(f"privacy: the adaptive clipping norm must be positive and finite, got {self.clip!r}")
        if any(b not in (0, 1) for b in self.bits):
            raise ValueError("privacy: each pending update's clipped bit is 0 or 1")


def plot_epsilons(path: Any, history: list[dict[str, Any]], *, target: float | None = None, unit: str = "time",
                  title: str = "") -> Any:
    """A figure of each client's ε over the run (``dp_epsilon_per_worker`` of each evaluation point),
    with the budget as a dashed line; returns ``path``."""
    try:
        import matplotlib  # noqa: PLC0415 - optional: the [plots] extra
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
        raise ModuleNotFoundError("figures need matplotlib: pip install 'fl-rescaled[plots]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [h for h in history if "dp_epsilon_per_worker" in h]
    times = [h["time"] for h in rows]
    eps = np.array([[e if math.isfinite(e) else np.nan for e in h["dp_epsilon_per_worker"]] for h in rows])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for w in range(eps.shape[1] if eps.ndim == 2 else 0):
        ax.plot(times, eps[:, w], lw=1.2, label=f"client {w}" if eps.shape[1] <= 10 else None)
    if target is not None:
        ax.axhline(target, ls="--", color="k", lw=1, label=f"budget ε = {target:g}")
    ax.set_xlabel(unit)
    ax.set_ylabel("ε (per client)")
    ax.set_title(title, fontsize=8)
    if eps.ndim == 2 and eps.shape[1] <= 10 or target is not None:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
