"""The project's ServerApp reads its run config from the same declarations as the command line."""

from __future__ import annotations

import logging
import tomllib

import pytest

from conftest import ROOT
from fl_rescaled.server_app import run_config_keys, spec_from_run_config


def test_pyproject_declares_exactly_the_keys_the_serverapp_reads():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert set(config) == run_config_keys()
    spec = spec_from_run_config(config)  # the app's own settings make a valid run
    assert (spec.task, spec.strategy, spec.taus, spec.budget) == ("quadratic", "rescaled", [1.0, 2.0], 2000.0)
    assert spec.options == {} and spec.delays == "fixed"  # "" keeps RunSpec's default


def test_strategy_options_are_the_command_lines_flags():
    spec = spec_from_run_config({"strategy": "fedbuff", "taus": "1,2",
                                 "strategy-options": "fedbuff-buffer-size=2 jobs-per-node=2 reply=gradient"})
    assert spec.options == {"buffer_size": 2, "jobs_per_node": 2, "reply": "gradient"}
    assert spec_from_run_config({"strategy": "rescaled", "strategy-options": "weights=0.25,0.75"}).options == {
        "weights": [0.25, 0.75]}


@pytest.mark.parametrize("cfg,message", [
    ({"bugdet": 3.0}, "unknown run-config key 'bugdet'"),
    ({"budget": "soon"}, "--budget: expected a finite number"),
    ({"strategy": "fedbuff", "strategy-options": "mixing=0.3"}, "fedbuff has no option 'mixing'"),
    ({"strategy": "fedasync", "strategy-options": "mixing"}, "expected key=value"),
    ({"strategy": "fedasync", "strategy-options": "fedasync-b=x"}, "--fedasync-b: expected an integer"),
])
def test_a_bad_key_or_value_names_itself(cfg, message):
    with pytest.raises(ValueError, match=message):
        spec_from_run_config(cfg)


def test_a_run_config_key_that_changes_nothing_is_warned_about_as_the_flag_is(caplog):
    """The ServerApp's run config follows the command line's rule (``runspec.ignored_lines``): a key
    set to a value that its run does not read gets one warning naming it (the quadratic task reads no
    ``dirichlet-alpha``; the virtual clock no ``time-unit``), and the keys it does read get none."""
    from fl_rescaled import run_inprocess
    from fl_rescaled.clients.client_app import app as client_app
    from fl_rescaled.server_app import app as server_app

    cfg = {"task": "quadratic", "taus": "1,2", "quad-a": "1,2", "quad-b": "4,-3", "lr": 0.01, "budget": 20.0}
    caplog.set_level(logging.WARNING, logger="flwr.fl_rescaled")
    run_inprocess(server_app, client_app, 2, run_config={**cfg, "dirichlet-alpha": 0.3, "time-unit": 0.5,
                                                         "strategy-options": "jobs-per-node=2"})
    warned = [r.getMessage() for r in caplog.records if "is ignored" in r.getMessage()]
    assert warned == ["run-config key 'dirichlet-alpha' is ignored: it applies to the mnist task only",
                      "run-config key 'time-unit' is ignored: it applies to the wall clock (--clock wall) only"]
    caplog.clear()
    run_inprocess(server_app, client_app, 2, run_config={**cfg, "clock": "wall", "time-unit": 0.01,
                                                         "emulate": "fixed"})
    assert not [r for r in caplog.records if "is ignored" in r.getMessage()]
