"""The project's Flower ServerApp: reads the run config, runs one asynchronous strategy on the Grid.

Used by ``flwr run .`` (Simulation Engine or a deployment); ``run_sim.py`` runs the same
``fl_rescaled.experiment.run`` on the in-process Grid. The run-config keys are the ``RunSpec``
fields (``eval-every``, ``taus = "1,2"``; an empty string keeps the field's default) plus
``strategy-options``, the strategy's constructor options as ``"key=value ..."`` (the command line's
flags without ``--``: ``"fedbuff-buffer-size=5 jobs-per-node=2"``). ``pyproject.toml`` must list
exactly these keys, which Flower requires (``tests/test_server_app.py`` checks it). A key set to a
value its run does not read (``time-unit`` on the virtual clock) gets one warning in the log, by
the command line's rule for its flags (``runspec.ignored_lines``).
"""

from __future__ import annotations

import logging
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from .experiment import RunSpec, make_strategy, run, to_json
from .manager import ManagerSettings
from .runspec import ignored_lines, manager_settings, run_settings
from .settings import Setting
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


def _given(cfg: dict[str, Any]) -> list[tuple[Setting, Any]]:
    """The run config's settings that are set (a value other than ""), with their values; raises
    ValueError naming an unknown key."""
    by_key = {f.key: f for f in run_settings() + manager_settings()}
    given = []
    for key, value in cfg.items():
        if key == STRATEGY_OPTIONS_KEY:
            continue
        if key not in by_key:
            raise ValueError(f"unknown run-config key {key!r}; the keys are {', '.join(sorted(run_config_keys()))}")
        if isinstance(value, str) and value.strip() == "":
            continue  # the field's default (Flower requires every key to be declared: "" leaves it unset)
        given.append((by_key[key], value))
    return given


def spec_from_run_config(cfg: dict[str, Any]) -> RunSpec:
    """Map a Flower run config onto a ``RunSpec``; raises ValueError naming a bad key or value."""
    values: dict[str, dict[str, Any]] = {"run": {}, "manager": {}}
    for f, value in _given(cfg):
        values[f.owner][f.name] = f.parse(str(value) if not isinstance(value, list) else ",".join(map(str, value)))
    spec = RunSpec(**values["run"], manager=ManagerSettings(**values["manager"]))
    spec.options = options.parse_options(spec.strategy, str(cfg.get(STRATEGY_OPTIONS_KEY, "")))
    return spec


def ignored_keys(cfg: dict[str, Any], spec: RunSpec) -> list[str]:
    """A warning line for each key set in the run config ``cfg`` (of ``spec``) that changes nothing
    in its run, by the command line's rule (``runspec.ignored_lines``)."""
    given = {f.name for f, _ in _given(cfg)} | set(spec.options)
    resolved = spec.resolved()
    return ignored_lines([(resolved, make_strategy(resolved))], given,
                         lambda name: f"run-config key '{name.replace('_', '-')}'")


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = dict(context.run_config)
    spec = spec_from_run_config(cfg)
    for line in ignored_keys(cfg, spec):
        log.warning("%s", line)
    log.info("fl-rescaled run: %s", spec)
    outcome = run(spec, grid=grid)
    print(RESULT_PREFIX + to_json(outcome), flush=True)
    if spec.out:
        log.info("outputs in %s", spec.out)
