"""Resuming a run from its checkpoint (``start(..., checkpoint=Checkpointing(..., resume=True))``).

The checkpoint holds the whole loop state: the model, the strategy's buffers and tables, the
manager's books, τ estimates and jobs in flight (each with the model and config it was sent with),
the clock with its random generators, the evaluation schedule, the history and the result so far.

- Virtual clock: the jobs that were in flight are sent again, as they were, so the run continues
  exactly as if it had never stopped (same final model, bit for bit).
- Wall clock: a restarted server cannot know what became of the jobs in flight, so they are booked
  as lost (reason ``resumed``); the nodes are found again (by partition with the partition query)
  and every online worker gets a job on the checkpoint's model; the clock goes on from the
  checkpoint's time.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

from flwr.serverapp import Grid

from fl_rescaled.checkpoints import read_state
from fl_rescaled.layout import ModelLayout
from fl_rescaled.manager import ManagerObserver, attach, lose_inflight, resend_inflight
from fl_rescaled.metrics import ProgressBar

from .loop import Checkpointing, EvaluateFn, Run
from .reporting import FederatedEvaluation

if TYPE_CHECKING:  # (the strategy imports this module; only its type is needed here)
    from .base import AsyncStrategy

log = logging.getLogger("flwr.fl_rescaled")


def run_fingerprint(strategy: AsyncStrategy, plan: Checkpointing, layout: ModelLayout, budget: float,
                    max_updates: int | None) -> Checkpointing:
    """``plan`` with a fingerprint that also covers the strategy, its options, the model's layout and
    the budgets: a checkpoint of any other run is refused."""
    what = {"run": plan.fingerprint, "strategy": type(strategy).__name__,
            "options": {k: repr(v) for k, v in strategy.describe().items()}, "model": layout.describe(),
            "budget": repr(budget), "updates": max_updates}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
    return Checkpointing(plan.path, plan.every, digest, plan.resume)


def resume_run(strategy: AsyncStrategy, plan: Checkpointing, grid: Grid, evaluate_fn: EvaluateFn | None,
               evaluate_config: Any, timeout: float, bar: ProgressBar,
               observers: list[ManagerObserver] | None) -> Run:
    """The loop state of ``plan``'s checkpoint, attached to ``strategy`` and ``grid``, ready to go on."""
    run: Run = read_state(plan.path, plan.fingerprint)
    on_event = strategy.on_event
    strategy.__dict__.update(run.s.__dict__)
    strategy.on_event = on_event
    manager = strategy.manager
    assert manager is not None
    attach(manager, grid, observers)
    fed_eval = FederatedEvaluation(grid, evaluate_config, timeout, fraction=strategy.fraction_evaluate,
                                   weighted_by_key=strategy.weighted_by_key, arrayrecord_key=strategy.arrayrecord_key,
                                   configrecord_key=strategy.configrecord_key)
    run.attach(strategy, evaluate_fn, fed_eval, bar, plan)
    if manager.clock.virtual:
        resend_inflight(manager)
        log.info("resumed from %s at t=%g (%d updates)", plan.path, manager.clock.now, manager.version)
        return run
    lost = lose_inflight(manager, "resumed")
    manager.membership.rediscover(min(timeout, 300.0))
    for worker in manager.online_workers():
        strategy.on_worker_joined(worker)
    log.warning("resumed from %s at t=%g (%d updates): %d jobs in flight counted as lost, %d of %d workers "
                "online", plan.path, manager.clock.now, manager.version, lost, len(manager.online_workers()),
                manager.num_workers)
    return run
