"""The Flower ServerApp: reads the run config, runs one asynchronous strategy on the given Grid.

Used by ``flwr run .`` (Simulation Engine or a deployment); ``run_sim.py`` runs the same
``fl_rescaled.experiment.run`` on the in-process Grid. Keys are those of
``[tool.flwr.app.config]`` in pyproject.toml; lists are comma-separated strings.
"""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from .experiment import RunSpec, run, to_json

log = logging.getLogger("fl_rescaled")

app = ServerApp()

_LISTS = {"taus", "weights", "quad_a", "quad_b"}


def spec_from_run_config(cfg: dict[str, Any]) -> RunSpec:
    """Map a Flower run config (``lr``, ``batch-size``, ``taus = "1,2"``...) onto a ``RunSpec``."""
    names = {f.name for f in fields(RunSpec)} - {"extra", "progress"}
    kw: dict[str, Any] = {}
    for key, value in cfg.items():
        name = key.replace("-", "_")
        if name not in names:
            continue
        if isinstance(value, str) and value.strip() == "":
            continue
        if name in _LISTS:
            value = [float(v) for v in str(value).split(",") if v.strip()]
        kw[name] = value
    for name in ("lr", "budget", "eval_every", "dirichlet_alpha", "quad_x0", "noise", "time_unit", "ttl",
                 "fedasync_mixing", "staleness_exponent", "malenia_s", "local_lr"):
        if name in kw:
            kw[name] = float(kw[name])
    for name in ("seed", "batch_size", "quad_dim", "num_clients", "jobs_per_node", "concurrency", "local_steps",
                 "fedbuff_buffer"):
        if name in kw:
            kw[name] = int(kw[name])
    for name in ("num_clients", "concurrency", "malenia_s", "local_lr"):  # 0 stands for "not set"
        if kw.get(name) == 0:
            del kw[name]
    if "ringleader_restart" in kw:
        kw["ringleader_restart"] = str(kw["ringleader_restart"]).lower() in ("1", "true", "yes")
    return RunSpec(**kw)


@app.main()
def main(grid: Grid, context: Context) -> None:
    spec = spec_from_run_config(dict(context.run_config))
    log.info("fl-rescaled run: %s", spec)
    outcome = run(spec, grid=grid)
    print("fl-rescaled result: " + to_json(outcome), flush=True)
    if spec.out:
        log.info("outputs in %s", spec.out)
