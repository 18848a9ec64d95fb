"""Plain asynchronous SGD with a pluggable stepsize rule, and strategies made from a rule alone."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fl_rescaled.algorithm import Completion, Run
from fl_rescaled.stepsizes import RULES, Rule, TauTable

from .base import AsyncStrategy


@dataclass
class ASGDState:
    """The cycle stepsize α this run uses (``lr``, or the method's default for the run)."""

    alpha: float = 1.0


class ASGD(AsyncStrategy):
    """Plain asynchronous SGD (the paper's Algorithm 1) with a stepsize rule.

    Every worker starts on the initial model; each reply is applied the moment it arrives
    (x ← x − γ g, k += 1) with γ = ``rule(α, worker, τ estimates, delay)``, and the new model goes
    straight back to the worker that sent it. No buffer, no table, nobody waits.

    Parameters
    ----------
    rule : callable or str (default: "vanilla")
        The stepsize rule: a name in ``fl_rescaled.stepsizes.RULES`` or a rule function
        ``rule(alpha, worker, taus, delay) -> γ`` (``fl_rescaled.stepsizes`` builds them).
    **kwargs
        The options of every strategy: as in ``AsyncStrategy``.
    """

    name = "asgd"
    dp_release = "sum"
    State = ASGDState

    def __init__(self, *, rule: Rule | str = "vanilla", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(rule, str):
            if rule not in RULES:
                raise ValueError(f"unknown stepsize rule {rule!r}; choose one of {', '.join(RULES)}")
            rule = RULES[rule]()
        self.rule = rule

    def table(self, run: Run) -> TauTable:
        """The τ table the rule reads: each worker's mean time between deliveries (``run.periods``)."""
        return run.periods

    def init_state(self, run: Run) -> ASGDState:
        return ASGDState(self.cycle_stepsize(run))

    def check_state(self, state: ASGDState, n: int, x: np.ndarray) -> None:
        """α must be positive and finite, and this run's ``lr`` when it was given."""
        del n, x
        if not (math.isfinite(state.alpha) and state.alpha > 0) or (self.lr_given and state.alpha != self.lr):
            raise ValueError(f"the strategy's cycle stepsize α = {state.alpha!r} is not this run's (lr = "
                             f"{self.lr if self.lr_given else 'the default'!r})")

    def cycle_stepsize(self, run: Run) -> float:
        """α for this run: ``lr`` (1 unless given)."""
        del run
        return self.lr

    def influence(self, run: Run, worker: int) -> float:
        """The rule's step at the worker's typical delay, per delivery period: γ_i(δ_i) / p_i (constant
        for Rescaled ASGD's rule, 1 / p_i for Vanilla's, smaller for the slow and stale under
        Delay-Adaptive's)."""
        taus = run.periods
        return self.rule(1.0, worker, self.table(run), taus.expected_delay(worker)) / taus.period(worker)

    def on_completion(self, run: Run, comp: Completion) -> None:
        run.apply(comp.worker, comp.update, self.rule(run.strategy_state.alpha, comp.worker, self.table(run), comp.delay))
        run.send_next(comp.worker)


def asgd_variant(name: str, factory: Callable[..., Rule]) -> type[ASGD]:
    """An ASGD strategy class whose stepsize rule is ``factory(**options)``.

    The class's options are the factory's keyword parameters (with their defaults, types and
    numpydoc descriptions, which the command line and the run config read) plus those of
    ``AsyncStrategy``; its docstring is the factory's. One registry line,
    ``"name": asgd_variant("name", stepsizes.my_rule)``, makes a new rule a strategy.
    """
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in inspect.signature(factory).parameters.values()]
    names = [p.name for p in params]

    def __init__(self, **kwargs: Any) -> None:
        own = {k: kwargs.pop(k) for k in names if k in kwargs}
        ASGD.__init__(self, rule=factory(**own), **kwargs)
        self.rule_options = {p.name: own.get(p.name, p.default) for p in params}

    def describe(self) -> dict[str, Any]:
        return {**AsyncStrategy.describe(self), **self.rule_options}

    __init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params,
         inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    title = "".join(part.capitalize() for part in name.split("-")) + "ASGD"
    return type(title, (ASGD,), {"__init__": __init__, "describe": describe, "name": name, "rule_factory": factory,
                                 "__doc__": factory.__doc__, "__module__": factory.__module__})
