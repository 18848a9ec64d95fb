"""The project's Flower ServerApp: reads the run config, runs one asynchronous strategy on the Grid.

Used by ``flwr run .`` (Simulation Engine or a deployment); ``run_sim.py`` runs the same
``fl_rescaled.experiment.run`` on the in-process Grid. The run-config keys are the ``RunSpec``
fields (``eval-every``, ``taus = "1,2"``; an empty string keeps the field's default) plus
``strategy-options``, the strategy's constructor options as ``"key=value ..."`` (the command line's
flags without ``--``: ``"fedbuff-buffer-size=5 jobs-per-node=2"``). ``pyproject.toml`` must list
exactly these keys, which Flower requires (``tests/test_server_app.py`` checks it).
"""

from __future__ import annotations

import logging
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from .experiment import RunSpec, run, to_json
from .manager import ManagerSettings
from .runspec import manager_settings, run_settings
from .strategies import options

log = logging.getLogger("flwr.fl_rescaled")

app = ServerApp()

#: The run-config keys besides the RunSpec fields.
STRATEGY_OPTIONS_KEY = "strategy-options"
#: What starts the line with the run's JSON outcome in the ServerApp's output (deployments read it).
RESULT_PREFIX = "fl-rescaled result: "


def run_config_keys() -> set[str]:
    """Every key the ServerApp reads (what ``[tool.flwr.app.config]`` must declare)."""
    return {f.key for f in run_settings() + manager_settings()} | {STRATEGY_OPTIONS_KEY}


def spec_from_run_config(cfg: dict[str, Any]) -> RunSpec:
    """Map a Flower run config onto a ``RunSpec``; raises ValueError naming a bad key or value."""
    by_key = {f.key: f for f in run_settings() + manager_settings()}
    values: dict[str, dict[str, Any]] = {"run": {}, "manager": {}}
    for key, value in cfg.items():
        if key == STRATEGY_OPTIONS_KEY:
            continue
        if key not in by_key:
            raise ValueError(f"unknown run-config key {key!r}; the keys are {', '.join(sorted(run_config_keys()))}")
        if isinstance(value, str) and value.strip() == "":
            continue  # the field's default (Flower requires every key to be declared: "" leaves it unset)
        f = by_key[key]
        values[f.owner][f.name] = f.parse(str(value) if not isinstance(value, list) else ",".join(map(str, value)))
    spec = RunSpec(**values["run"], manager=ManagerSettings(**values["manager"]))
    spec.options = options.parse_options(spec.strategy, str(cfg.get(STRATEGY_OPTIONS_KEY, "")))
    return spec


@app.main()
def main(grid: Grid, context: Context) -> None:
    spec = spec_from_run_config(dict(context.run_config))
    log.info("fl-rescaled run: %s", spec)
    outcome = run(spec, grid=grid)
    print(RESULT_PREFIX + to_json(outcome), flush=True)
    if spec.out:
        log.info("outputs in %s", spec.out)
