"""Server-side differential privacy for any asynchronous strategy: ``AsyncDPFixedClipping``.

The asynchronous counterpart of Flower's ``DifferentialPrivacyServerSideFixedClipping``: wrap a
strategy, ``AsyncDPFixedClipping(FedBuff(...), noise_multiplier=1.0, clipping_norm=0.5)``, and call
``start`` as usual. The mechanism and its accountant are ``fl_rescaled.privacy``; ``docs/privacy.md``
says what is protected and what is not.
"""

from __future__ import annotations

import logging
import math
from dataclasses import make_dataclass
from typing import Any

import numpy as np

from fl_rescaled.algorithm import Completion, Run
from fl_rescaled.bounds import BoundOptions
from fl_rescaled.bounds import update_norm
from fl_rescaled.privacy import (BIT_STDDEV_FACTOR, AdaptiveClipping, PrivacyOptions, PrivacyState, check_available,
                                 clip_norm_next, epsilon, update_noise_multiplier)

from .base import AsyncStrategy
from .checks import refuse_round_wrapper
from .facade import FlowerFacade

log = logging.getLogger("flwr.fl_rescaled")


class PrivateRun:
    """The ``Run`` the wrapped strategy sees: its own state, noise on every aggregate it applies,
    and no job for a client whose budget would be exceeded; everything else is the run's."""

    def __init__(self, run: Run, dp: AsyncDPFixedClipping) -> None:
        self._run, self._dp = run, dp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run, name)

    @property
    def strategy_state(self) -> Any:
        return self._run.strategy_state.inner

    @property
    def privacy(self) -> PrivacyState:
        return self._run.strategy_state.privacy

    @property
    def outer_state(self) -> Any:
        return self._run.strategy_state

    def apply(self, worker: int, update: np.ndarray, stepsize: float, booked: float | None = None) -> None:
        """x ← x − γ (Σ clipped updates + N(0, σ²)): the noise goes on the sum the strategy applies."""
        self._run.apply(worker, self._dp.release(self._run.strategy_state, update), stepsize, booked)

    def send(self, worker: int) -> None:
        if self._dp.admits(self.outer_state, worker):
            self.privacy.inflight[worker] += 1
            self._run.send(worker)

    def send_next(self, after: int | None) -> None:
        if after is not None and self._run.concurrency >= self._run.n and not self._dp.admits(self.outer_state, after):
            return  # (with C = N the slot is the worker's: it stays idle)
        worker = self._run.send_next(after)
        if worker is not None:
            self.privacy.inflight[worker] += 1


class AsyncDPFixedClipping(FlowerFacade):
    """Central (server-side) DP with fixed clipping for any asynchronous strategy of ``dp_release = "sum"``.

    Every accepted client update g_i is clipped to ‖g_i‖ ≤ C (``clipping_norm``; a ``clip`` bound,
    the last the update passes) and every aggregate the strategy applies gets Gaussian noise
    N(0, σ² I), σ = ``noise_multiplier`` × C, before its step: x ← x − γ (A + σ ξ).

    Sensitivity of one client's contribution, per strategy (the A each one applies):

    - the ASGD family (Vanilla, Rescaled, Delay-Adaptive, damped Rescaled) and Concurrent ASGD:
      A = g_i, one clipped update: sensitivity C. Rescaled ASGD's γ_i (which grows with τ_i)
      scales the update and the noise alike: in the model, γ_i C against γ_i σ, the same ratio
      z, so a slow client's larger steps cost no more privacy per release;
    - FedAsync: A = (x − x_τ) + g_i; x − x_τ is earlier releases (public): sensitivity C;
    - FedBuff: A = Σ_j w(δ_j) g_j over the K buffered updates, w ≤ 1: sensitivity C for a client
      with one update in the buffer, m·C with m (counted: noise multiplier z / m for that release);
      the noise goes on the sum, before dividing by K.

    Methods that reuse stored updates in later steps (Malenia, Ringleader: a table of every
    client's latest gradient; Minibatch and FedAvg: a mean whose weights may exceed 1) are refused.
    The outlier guard and the median clip are turned off: each decides from the other clients'
    norms, so one client's data would change what happens to the others' updates.

    Parameters
    ----------
    strategy : AsyncStrategy
        The strategy to make private (FedBuff, FedAsync, an ASGD).
    noise_multiplier : float
        z ≥ 0; σ = z × C. 0 clips without noise (ε infinite).
    clipping_norm : float
        C > 0, the L2 norm every client update is clipped to.
    delta : float, optional (default: min(1e-5, 1 / N^1.1) for N clients)
        The δ of every (ε, δ) reported.
    target_epsilon : float, optional (default: none)
        Each client's budget: a client whose ε at δ would exceed it after one more update gets no
        more jobs (one log line names it): with C = N its slot stays empty, with C < N the
        selection passes it over (``admits``) on either clock; the run stops, with a warning, when
        fewer than ``min(min_train_nodes, N)`` clients remain.
    seed : int, optional (default: fresh entropy)
        Seeds the noise (a simulation's reproducibility; leave it out in a deployment). The
        generator's state is part of every checkpoint, so a resumed run draws the same noise.
    """

    def __init__(self, strategy: AsyncStrategy, *, noise_multiplier: float, clipping_norm: float,
                 delta: float | None = None, target_epsilon: float | None = None, seed: int | None = None) -> None:
        super().__init__()
        if isinstance(strategy, AsyncDPFixedClipping):
            raise ValueError("this strategy is already private: wrap the inner strategy once")
        if not isinstance(strategy, AsyncStrategy):
            raise TypeError(f"AsyncDPFixedClipping wraps an asynchronous strategy of fl_rescaled.strategies, got "
                            f"{type(strategy).__name__} (for Flower's strategies use Flower's DP wrappers)")
        if getattr(strategy, "dp_release", None) != "sum":
            raise ValueError(f"{type(strategy).__name__} reuses stored updates in later steps, so one client's "
                             "update is in many releases; differential privacy supports FedBuff, FedAsync and the "
                             "ASGD methods")
        check_available()
        self.__dict__["strategy"] = strategy
        self.privacy = PrivacyOptions(noise_multiplier, clipping_norm, delta, target_epsilon, seed)
        self.bounds = BoundOptions(outlier_factor=None, clip_factor=None, adaptive_clip=None,
                                   clip_norm=float(clipping_norm))
        self.State = make_dataclass("PrivateState", [("inner", strategy.State), ("privacy", PrivacyState)])

    def __getattr__(self, name: str) -> Any:
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)

    # ---------------------------------------------------------------- the algorithm, delegated
    def init_state(self, run: Run) -> Any:
        if getattr(getattr(run, "state", None), "replica_lrs", None) is not None:
            raise ValueError("differential privacy cannot run batched replicas (experiment.run_batch, start(replicas="
                             "...)): their updates travel as one vector that no bound clips replica by replica, and "
                             "one noise draw would cover them all; run each replica on its own (experiment.run)")
        return self.State(*self.fresh_parts(run))

    def fresh_parts(self, run: Run) -> tuple[Any, ...]:
        """The fields of a fresh ``State``: the inner strategy's state and the accountant's."""
        return self.strategy.init_state(PrivateRun(run, self)), PrivacyState.fresh(run.n, self.privacy.seed)

    def check_state(self, state: Any, n: int, x: np.ndarray) -> None:
        self.strategy.check_state(state.inner, n, x)
        if len(state.privacy.counts) != n:
            raise ValueError(f"the accountant's state counts {len(state.privacy.counts)} clients, not this run's {n}")

    def on_start(self, run: Run) -> None:
        self.strategy.on_start(PrivateRun(run, self))

    def on_completion(self, run: Run, comp: Completion) -> None:
        view = PrivateRun(run, self)
        view.privacy.inflight[comp.worker] = max(0, view.privacy.inflight[comp.worker] - 1)
        view.privacy.pending.append(comp.worker)
        self.strategy.on_completion(view, comp)

    def on_rejected(self, run: Run, comp: Completion) -> None:
        view = PrivateRun(run, self)
        view.privacy.inflight[comp.worker] = max(0, view.privacy.inflight[comp.worker] - 1)
        self.strategy.on_rejected(view, comp)

    def on_joined(self, run: Run, worker: int) -> None:
        self.strategy.on_joined(PrivateRun(run, self), worker)

    def influence(self, run: Run, worker: int) -> float:
        return self.strategy.influence(PrivateRun(run, self), worker)

    def stored_vectors(self, state: Any) -> int:
        return self.strategy.stored_vectors(state.inner)

    def release(self, state: Any, update: np.ndarray) -> np.ndarray:
        """The aggregate ``update`` with its noise, N(0, (z C)²) per coordinate (one release)."""
        return state.privacy.release(update, self.privacy.sigma)

    # ---------------------------------------------------------------- budgets and reports
    def admits(self, state: Any, worker: int) -> bool:
        """Whether ``worker`` may get a job: its ε stays within ``target_epsilon`` even when this job's
        update, and every one it has pending or in flight, is released. The first no sets it aside
        for the rest of the run (``excluded``, in checkpoints). The selection asks this with C < N."""
        st, opts = state.privacy, self.privacy
        if opts.target_epsilon is None:
            return True
        if st.excluded[worker]:
            return False
        delta = opts.delta_for(len(st.counts))
        if epsilon(st.spent_if(worker, 1), opts.noise_multiplier, delta) <= opts.target_epsilon:
            return True
        st.excluded[worker] = True
        log.warning("client %d is no longer selected: one more update would take its ε past the budget %g "
                    "(δ = %.3g; %d updates applied, ε = %.4g)", worker, opts.target_epsilon, delta,
                    st.contributions()[worker], epsilon(st.of(worker), opts.noise_multiplier, delta))
        return False

    def stopped(self, state: Any) -> str | None:
        """Why the run stops now: too few clients are left within their budget."""
        if self.privacy.target_epsilon is None:
            return None
        n = len(state.privacy.counts)
        left, needed = n - int(state.privacy.excluded.sum()), min(self.population.min_train_nodes, n)
        if left >= needed:
            return None
        return (f"privacy budgets spent: {left} of {n} clients may still train within ε ≤ "
                f"{self.privacy.target_epsilon:g} (δ = {self.privacy.delta_for(n):.3g}), fewer than the "
                f"{needed} needed (min_train_nodes); the run stops here")

    def report(self, state: Any) -> dict[str, Any]:
        """The ``"dp"`` object of the outputs: the options, per-client contributions and ε, max and mean."""
        opts, n = self.privacy, len(state.privacy.counts)
        delta = opts.delta_for(n)
        return {"noise_multiplier": opts.noise_multiplier, "clipping_norm": opts.clipping_norm, "delta": delta,
                "target_epsilon": opts.target_epsilon, "accountant": "rdp (dp-accounting), no amplification",
                **state.privacy.report(opts.noise_multiplier, delta)}

    def describe(self) -> dict[str, Any]:
        out = {**self.strategy.describe(), "outlier_factor": None, "clip_factor": None, "adaptive_clip": None,
               "clip_norm": self.privacy.clipping_norm}
        return {**out, "dp_noise_multiplier": self.privacy.noise_multiplier, "dp_delta": self.privacy.delta,
                "dp_target_epsilon": self.privacy.target_epsilon, "dp_seed": self.privacy.seed}

    def summary(self) -> None:
        refuse_round_wrapper(self)
        log.info("\t├──> DP: noise multiplier %g, clipping norm %g, δ %s, target ε %s (per client, RDP accountant)",
                 self.privacy.noise_multiplier, self.privacy.clipping_norm,
                 "1/N^1.1 (≤ 1e-5)" if self.privacy.delta is None else f"{self.privacy.delta:g}",
                 "none" if self.privacy.target_epsilon is None else f"{self.privacy.target_epsilon:g}")
        super().summary()


def _bound_option(name: str) -> property:
    return property(lambda self: getattr(self.bounds, name), doc=f"The private run's ``{name}`` (``self.bounds``).")


for _name in ("outlier_factor", "clip_factor", "adaptive_clip", "clip_norm"):  # (the wrapper's bounds, not the inner's)
    setattr(AsyncDPFixedClipping, _name, _bound_option(_name))


class AsyncDPAdaptiveClipping(AsyncDPFixedClipping):
    """Central DP with adaptive clipping (Andrew et al., "Differentially Private Learning with Adaptive
    Clipping", NeurIPS 2021) for any asynchronous strategy of ``dp_release = "sum"``: the
    asynchronous counterpart of Flower's ``DifferentialPrivacyServerSideAdaptiveClipping``,
    ``AsyncDPAdaptiveClipping(FedBuff(...), noise_multiplier=1.0, initial_clipping_norm=0.1)``.

    The clipping norm C_t follows the ``target_clipped_quantile`` q of the update norms, estimated
    privately. Every update g_i that arrives is clipped to the current C_t and leaves a bit
    b_i = 1[‖g_i‖ ≤ C_t]. A release (as ``AsyncDPFixedClipping``'s: per update for the ASGD family
    and FedAsync, per buffer for FedBuff) of the n pending updates is now a pair, made with the same
    C_t for all of them (C changes only at a release, so every update of a buffer was clipped to it):

    - the aggregate plus N(0, (z_Δ C_t)²) per coordinate, and
    - the centred clipped count S = Σ (b_i − ½) + N(0, σ_b²), σ_b = ``clipped_count_stddev``;

    then b̃ = S / n + ½ and C_{t+1} = C_t · exp(−η (b̃ − q)), η = ``clip_norm_lr``. n, the number of
    updates in the release (1, or FedBuff's K), is public with the schedule, as in
    ``AsyncDPFixedClipping``; Andrew et al. divide by the expected cohort size for the same reason.

    Calibration: for a client with m updates in a release, the pair has sensitivity m C_t (update)
    and m/2 (count); with noise z_Δ C_t and σ_b it is a Gaussian mechanism with RDP
    α m² (z_Δ⁻² + (2σ_b)⁻²) / 2 = α m² / (2 z²) exactly when z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2)
    (their Theorem 1; ``fl_rescaled.privacy.update_noise_multiplier``). So the accountant charges
    each release at noise multiplier z / m, the same as fixed clipping at ``noise_multiplier`` z,
    and the update's noise is z_Δ C_t (> z C_t): the price of releasing the bit.

    Asynchronously, one bit per release (the ASGD family, FedAsync) makes b̃ − q noisy (std σ_b,
    about z): C_t then moves by ±η σ_b per update around its target, where a round of m clients
    moves it by ±η σ_b / m. Lower ``clip_norm_lr`` by the number of updates a round would hold to
    keep C as steady as Flower's wrapper keeps it; FedBuff's buffer of K plays the round's part.

    Parameters
    ----------
    strategy : AsyncStrategy
        The strategy to make private (FedBuff, FedAsync, an ASGD).
    noise_multiplier : float
        z ≥ 0, the effective noise multiplier of each release (update and count together; what the
        accountant charges). The update's own is z_Δ (above). 0: no noise, exact bits, ε infinite.
    initial_clipping_norm : float (default: 0.1, as Flower's)
        C_0 > 0.
    target_clipped_quantile : float (default: 0.5)
        q in (0, 1): the fraction of updates C_t should leave unclipped.
    clip_norm_lr : float (default: 0.2)
        η > 0, the geometric step of C per release.
    clipped_count_stddev : float, optional (default: 1.2 × noise_multiplier)
        σ_b, the noise on each release's centred count; it must exceed z / 2. The default makes
        z_Δ ≈ 1.10 z.
    delta, target_epsilon, seed
        As ``AsyncDPFixedClipping``'s (the seed draws the count's noise too).
    """

    def __init__(self, strategy: AsyncStrategy, *, noise_multiplier: float, initial_clipping_norm: float = 0.1,
                 target_clipped_quantile: float = 0.5, clip_norm_lr: float = 0.2,
                 clipped_count_stddev: float | None = None, delta: float | None = None,
                 target_epsilon: float | None = None, seed: int | None = None) -> None:
        super().__init__(strategy, noise_multiplier=noise_multiplier, clipping_norm=initial_clipping_norm,
                         delta=delta, target_epsilon=target_epsilon, seed=seed)
        q, lr, sb = target_clipped_quantile, clip_norm_lr, clipped_count_stddev
        if isinstance(q, bool) or not (isinstance(q, (int, float)) and 0 < q < 1):
            raise ValueError(f"target_clipped_quantile must be in (0, 1), got {q!r}")
        if isinstance(lr, bool) or not (isinstance(lr, (int, float)) and 0 < lr <= 10):
            raise ValueError(f"clip_norm_lr must be in (0, 10], got {lr!r}")
        if sb is None:
            sb = BIT_STDDEV_FACTOR * float(noise_multiplier)
        elif isinstance(sb, bool) or not (isinstance(sb, (int, float)) and 0 <= sb < math.inf):
            raise ValueError(f"clipped_count_stddev must be a finite number ≥ 0, got {sb!r}")
        self.target_clipped_quantile, self.clip_norm_lr, self.clipped_count_stddev = float(q), float(lr), float(sb)
        self.update_noise = update_noise_multiplier(float(noise_multiplier), self.clipped_count_stddev)
        self.bounds = BoundOptions(outlier_factor=None, clip_factor=None, adaptive_clip=None, clip_norm=None)
        self.State = make_dataclass("PrivateAdaptiveState", [("inner", strategy.State), ("privacy", PrivacyState),
                                                             ("adaptive", AdaptiveClipping)])

    def fresh_parts(self, run: Run) -> tuple[Any, ...]:
        return (*super().fresh_parts(run), AdaptiveClipping(self.privacy.clipping_norm, []))

    def check_state(self, state: Any, n: int, x: np.ndarray) -> None:
        super().check_state(state, n, x)
        if len(state.adaptive.bits) != len(state.privacy.pending):
            raise ValueError(f"the checkpoint holds {len(state.adaptive.bits)} clipped bits for "
                             f"{len(state.privacy.pending)} pending updates")

    def on_completion(self, run: Run, comp: Completion) -> None:
        """Clip the update to the current C and keep its bit for the next release."""
        ad = run.strategy_state.adaptive
        norm = 0.0 if comp.update is None else update_norm(comp.update)
        ad.bits.append(int(norm <= ad.clip))  # (one bit per pending update)
        if norm > ad.clip:
            comp.update = comp.update * comp.update.dtype.type(ad.clip / norm)
        super().on_completion(run, comp)

    def release(self, state: Any, update: np.ndarray) -> np.ndarray:
        """The aggregate with N(0, (z_Δ C)²) per coordinate, then the noisy count and the next C."""
        ad, n = state.adaptive, len(state.adaptive.bits)
        noisy = state.privacy.release(update, self.update_noise * ad.clip)
        if n:
            count = sum(ad.bits) - n / 2 + float(state.privacy.rng.normal(0.0, self.clipped_count_stddev))
            ad.clip = clip_norm_next(ad.clip, count / n + 0.5, self.target_clipped_quantile, self.clip_norm_lr)
        ad.bits.clear()
        return noisy

    def report(self, state: Any) -> dict[str, Any]:
        return {**super().report(state), "clipping_norm": state.adaptive.clip,
                "initial_clipping_norm": self.privacy.clipping_norm,
                "target_clipped_quantile": self.target_clipped_quantile, "clip_norm_lr": self.clip_norm_lr,
                "clipped_count_stddev": self.clipped_count_stddev, "update_noise_multiplier": self.update_noise}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "clip_norm": None, "dp_target_clipped_quantile": self.target_clipped_quantile,
                "dp_clip_norm_lr": self.clip_norm_lr, "dp_clipped_count_stddev": self.clipped_count_stddev}

    def summary(self) -> None:
        refuse_round_wrapper(self)
        log.info("\t├──> DP, adaptive clipping: initial norm %g, target quantile %g, lr %g, count noise σ_b %g "
                 "(update noise multiplier %g for an effective %g)", self.privacy.clipping_norm,
                 self.target_clipped_quantile, self.clip_norm_lr, self.clipped_count_stddev, self.update_noise,
                 self.privacy.noise_multiplier)
        super().summary()
