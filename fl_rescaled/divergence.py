"""A model that diverges is a failure: the evaluated loss watched at every evaluation point.

A run whose model blows up (a lying client that outweighs the honest ones, a stepsize far too
large) would otherwise end with status ``completed`` and a ruined model. At each evaluation point
the driver hands ``Divergence.point`` the metrics of that point; the loss it watches is the
central evaluation's (``evaluate_fn``), else the federated evaluation's: the key ``loss``, else
the first key, in sorted order, that ends in ``loss`` (``eval_loss``, ``test_loss``). The run
fails (``RunFailed``, one line naming the clients whose updates were largest, and the best model
so far in ``RunFailed.result``) when that loss

- is not finite (NaN or ±inf), at once; or
- is above ``FACTOR`` × its first value at ``POINTS`` evaluation points in a row (the first value:
  the central loss at the start, step 0; the federated one at the first point after it, since the
  nodes evaluate after each round's worth of trainings, as FedAvg's, not before the first).

Why 10 and 3: an honest run's loss is below its initial loss within a few points, and on
MNIST the largest honest loss in the paper's α sweeps (the diverging α included) stayed within
1.4 × the initial loss (2.3 → at most 3.1); ten times the start is a model gone, not a noisy
point. Three points in a row keep one bad evaluation (a federated evaluation whose nodes were
unlucky) from ending a run. The rule needs a first loss: without one (no ``evaluate_fn`` and
no federated evaluation reporting a loss, or a first loss of 0) only non-finite losses count. ``start(divergence=None)`` turns the check off (the studies' α sweeps record a diverged run
as +inf instead of stopping it).

The best model: the model of the evaluation point with the lowest such loss, kept (as data, in
the run's state and checkpoints) so that a failed run still hands it back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: A loss above this many times the initial one counts as exploding.
FACTOR = 10.0
#: This many exploding evaluation points in a row end the run.
POINTS = 3


def loss_of(metrics: dict[str, Any] | None) -> tuple[str, float] | None:
    """(key, value) of the loss ``metrics`` report (``loss``, else the first key ending in ``loss``;
    a number, not a list), or None."""
    if not metrics:
        return None
    keys = ["loss"] if "loss" in metrics else sorted(k for k in metrics if str(k).endswith("loss"))
    for key in keys:
        value = metrics[key]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return key, float(value)
    return None


@dataclass
class DivergenceState:
    """What the check has seen: the watched loss (its source and key), the loss at step 0, how many
    points in a row were above ``FACTOR`` × it, and the best point (its loss, step and model)."""

    source: str = ""
    initial: float = math.nan
    above: int = 0
    best_loss: float = math.inf
    best_step: int = -1
    best_x: np.ndarray = field(default_factory=lambda: np.zeros(0))
    best_carried: dict[str, np.ndarray] = field(default_factory=dict)

    def check(self) -> None:
        if self.above < 0 or self.best_step < -1 or math.isnan(self.best_loss):
            raise ValueError("divergence: a count below 0 or a best loss that is not a number")
        if self.best_x.ndim != 1 or (self.best_step >= 0 and not np.isfinite(self.best_x).all()):
            raise ValueError("divergence: the best model must be a flat finite vector")


@dataclass(frozen=True)
class Divergence:
    """The rule (``FACTOR``, ``POINTS``); ``point`` applies it to one evaluation point."""

    factor: float = FACTOR
    points: int = POINTS

    def __post_init__(self) -> None:
        if not (1 < self.factor < math.inf) or isinstance(self.points, bool) or not 1 <= self.points <= 10_000:
            raise ValueError(f"divergence: a factor above 1 and 1..10000 points, got {self.factor!r}, {self.points!r}")

    def point(self, state: DivergenceState, step: int, server: dict | None, federated: dict | None,
              model: Any) -> str | None:
        """Record evaluation point ``step`` (its central and federated metrics); return why the run
        diverged, or None. ``model()`` gives (flat x, carried arrays) of that point, asked for only
        when it is the best so far."""
        found = None
        for source, metrics in (("server", server), ("federated", federated)):
            got = loss_of(metrics)
            if got is not None:
                found = (f"{source} {got[0]}", got[1])
                break
        if found is None:
            return None
        source, loss = found
        if not state.source:
            state.source = source
        elif source != state.source:  # (the watched loss is the one the run started with)
            return None
        if math.isnan(state.initial):  # (the first: the start's central loss, or the first federated one)
            state.initial = loss
        if not math.isfinite(loss):
            return f"its {source} is {loss} at evaluation point {step}"
        if loss < state.best_loss:
            state.best_loss, state.best_step = loss, step
            state.best_x, state.best_carried = model()
        limit = self.factor * state.initial
        if state.initial > 0 and loss > limit:
            state.above += 1
        else:
            state.above = 0
        if state.above >= self.points:
            return (f"its {source} was above {self.factor:g} × its initial {state.initial:.4g} at {state.above} "
                    f"evaluation points in a row (now {loss:.4g}, at point {step})")
        return None
