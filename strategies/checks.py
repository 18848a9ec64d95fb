"""The checks of the options every strategy has (``AsyncStrategy``'s constructor): each bad value is
a ``ValueError`` that names the option, whatever its type (a string where a number belongs too)."""

from __future__ import annotations

import math
import sys
from typing import Any

from flwr.serverapp.strategy import Strategy

from fl_rescaled.manager import SELECTORS

REPLIES = ("gradient", "model")
MAX_REJECTIONS = 1_000_000


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any, least: int) -> bool:
    return _number(value) and int(value) == value and value >= least


def check_common(strategy: str, restarts_at_once: bool, *, lr: Any, reply: Any, jobs_per_node: Any,
                 fraction_evaluate: Any, max_consecutive_rejections: Any, concurrency: Any, selection: Any,
                 fraction_train: Any, min_train_nodes: Any, min_available_nodes: Any, min_evaluate_nodes: Any,
                 train_metrics_aggr_fn: Any, evaluate_metrics_aggr_fn: Any) -> None:
    """Raise ``ValueError`` for the first bad common option of ``strategy`` (a class name)."""
    if lr is not None and not (_number(lr) and lr > 0):
        raise ValueError(f"the cycle stepsize lr (α) must be positive, got {lr!r}")
    if reply not in REPLIES:
        raise ValueError(f"reply must be one of {REPLIES}, got {reply!r}")
    if not (isinstance(jobs_per_node, int) and _integer(jobs_per_node, 1) and jobs_per_node <= 1000):
        raise ValueError(f"jobs_per_node must be an integer in 1..1000, got {jobs_per_node!r}")
    if jobs_per_node != 1 and not restarts_at_once:
        raise ValueError(f"{strategy} keeps one job per worker (jobs_per_node=1)")
    if not (_number(fraction_evaluate) and 0.0 <= fraction_evaluate <= 1.0):
        raise ValueError(f"fraction_evaluate must be in [0, 1], got {fraction_evaluate!r}")
    if not (isinstance(selection, str) and selection in SELECTORS):
        raise ValueError(f"selection must be one of {', '.join(SELECTORS)} (fl_rescaled.manager.SELECTORS), "
                         f"got {selection!r}")
    if not (_number(fraction_train) and 0.0 < fraction_train <= 1.0):
        raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train!r}")
    for name, value, least in (("max_consecutive_rejections", max_consecutive_rejections, 1),
                               ("concurrency", concurrency, 1), ("min_train_nodes", min_train_nodes, 1),
                               ("min_available_nodes", min_available_nodes, 1),
                               ("min_evaluate_nodes", min_evaluate_nodes, 0)):
        if value is not None and not _integer(value, least):
            raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}")
    if max_consecutive_rejections is not None and max_consecutive_rejections > MAX_REJECTIONS:
        raise ValueError(f"max_consecutive_rejections must be at most {MAX_REJECTIONS:,} (more would turn the "
                         f"failure check off), got {max_consecutive_rejections!r}")
    for name, fn in (("train_metrics_aggr_fn", train_metrics_aggr_fn),
                     ("evaluate_metrics_aggr_fn", evaluate_metrics_aggr_fn)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a function (list[RecordDict], str) -> MetricRecord")
    if concurrency is not None and jobs_per_node != 1:
        raise ValueError("jobs_per_node applies when every worker is always busy; with concurrency, one job per worker")


def every_worker_each_round(strategy: Any, run: Any) -> None:
    """Refuse a population (C < N) for a method whose rounds wait for every worker."""
    if run.concurrency < run.n:
        raise ValueError(f"{type(strategy).__name__}'s rounds wait for every worker: it needs every node training "
                         f"(concurrency {run.concurrency} < {run.n} workers)")


ROUND_HOOKS = {  # FedAvg's round hooks, never called by an asynchronous strategy, and what to use instead
    "configure_train": "override configure_job(config, *, updates, time)",
    "aggregate_train": "each reply is applied as it arrives: use the update bounds, train_metrics_aggr_fn "
                       "or start(observers=...)",
    "configure_evaluate": "use fraction_evaluate, min_evaluate_nodes and start(evaluate_config=...)",
    "aggregate_evaluate": "use evaluate_metrics_aggr_fn or on_evaluation",
}


def no_round_hooks(cls: type) -> None:
    """Refuse a subclass that overrides a round hook (it would be silently never called)."""
    for hook, instead in ROUND_HOOKS.items():
        if hook in vars(cls):
            raise TypeError(f"{cls.__name__} overrides {hook}, which an asynchronous strategy never calls: "
                            f"{instead} (docs/migrating.md)")


def wrapper_fix(wrapper: str) -> str:
    """The one-line way forward for an asynchronous strategy inside Flower's wrapper ``wrapper``."""
    ours = "AsyncDPAdaptiveClipping" if "Adaptive" in wrapper else "AsyncDPFixedClipping"
    options = ("noise_multiplier=..., initial_clipping_norm=..., target_clipped_quantile=..."
               if ours == "AsyncDPAdaptiveClipping" else "noise_multiplier=..., clipping_norm=...")
    return (f"for differential privacy wrap it in fl_rescaled.{ours}(strategy, {options}) and call its start() "
            "(AsyncDPFixedClipping and AsyncDPAdaptiveClipping: docs/privacy.md)")


def refuse_round_wrapper(strategy: Any) -> None:
    """Called first in each ``summary`` of ours: raise ``TypeError`` when what called
    ``strategy.summary`` (the ``self`` of the first frame up the stack that is not one of
    ``strategy``'s own methods, such as a subclass's ``summary`` calling its parent's) is a
    round-based Flower ``Strategy`` holding ``strategy`` as its ``strategy`` (Flower's
    ``DifferentialPrivacy*`` wrappers, whose ``start`` logs the inner strategy's summary before its
    first round): the run stops there, before any message is sent, naming our wrappers. Flower's
    constructors only store the strategy, so this is the first call that reaches ours."""
    frame = sys._getframe(1)  # noqa: SLF001 - (who called: Flower passes nothing that says it)
    while frame is not None and frame.f_locals.get("self") is strategy:
        frame = frame.f_back
    caller = None if frame is None else frame.f_locals.get("self")
    if not isinstance(caller, Strategy) or caller is strategy or type(caller).configure_train is no_rounds:
        return  # (not Flower's, or one of ours: its round hooks are ``no_rounds``)
    if getattr(caller, "__dict__", {}).get("strategy") is strategy:
        name = type(caller).__name__
        raise TypeError(f"{name} is round-based and cannot drive {type(strategy).__name__}, which is asynchronous "
                        f"(no rounds, no fixed number of replies per aggregate); {wrapper_fix(name)}")


def no_rounds(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(f"{type(self).__name__} is asynchronous: call start(), not rounds; Flower's round-based "
                              f"DP wrappers (DifferentialPrivacy*) cannot drive it: {wrapper_fix('')}")
