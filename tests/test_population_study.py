"""``python run_sim.py population``: the study's pieces on small made-up inputs (grid ladder,
sweep extension, verdicts, run specs), then the quick study on real MNIST: every method runs in every
setting, the report has its sections, and its verdict sections list exactly what the numbers say."""

from __future__ import annotations

import csv
import json
import math
import re

import pytest

from fl_rescaled.population import METHODS, SETTINGS, Setting, half_step, spec_for, verdicts
from fl_rescaled.population.config import BY_NAME, MODEL, fedavg_concurrency
from fl_rescaled.population.report import NOT_WIN, TITLE
from fl_rescaled.population.results import METRICS
from fl_rescaled.population.runner import HalfDecadeSweep


def MNIST(test):  # the quick study: about a minute on real MNIST with 2 processes
    return pytest.mark.slow(pytest.mark.mnist(test))


# ------------------------------------------------------------------------------ pieces
def test_grid_ladder_and_sweep_extension_past_a_winning_edge():
    assert [half_step(a, True) for a in (0.03, 0.1, 0.3, 1, 3, 10)] == [0.1, 0.3, 1, 3, 10, 30]
    assert [half_step(a, False) for a in (0.1, 0.3, 1, 3, 10)] == [0.03, 0.1, 0.3, 1, 3]
    sw = HalfDecadeSweep("s", "m", [0.1, 0.3, 1.0], 2, 1)
    for a, loss in ((0.1, 0.9), (0.3, 0.5), (1.0, 0.4)):  # the top edge wins: extend to 3
        sw.results[(a, 0)] = {"final_loss": loss}
    assert sw.needed() == [(3.0, 0)]
    sw.results[(3.0, 0)] = {"final_loss": 0.45}
    assert sw.needed() == [(1.0, 1)] and sw.chosen == 1.0 and sw.note == "interior"
    low = HalfDecadeSweep("s", "m", [0.1, 0.3], 1, 1)
    low.results.update({(0.1, 0): {"final_loss": 0.2}, (0.3, 0): {"final_loss": 0.5}})
    assert low.needed() == [(0.03, 0)]  # (the paper's sweep goes to 0.01 below 1)


def _summary(values: dict[str, tuple[float, float, float]], n: int = 3) -> dict:
    """A results.summary for one setting: method → (final loss, worst, accuracy), ranges ±0.01."""
    return {m: {"n": n, "loss_med": a, "worst": w, "acc": c,
                "ranges": {"loss_med": (a - .01, a + .01), "worst": (w - .01, w + .01), "acc": (c - .01, c + .01)}}
            for m, (a, w, c) in values.items()}


def test_verdicts_compare_rate_rescaling_with_the_best_other_method_per_metric():
    summary = {"s": _summary({"rescaled-rate": (0.30, 1.0, 0.90), "vanilla": (0.35, 0.8, 0.90),
                              "fedbuff": (0.305, 1.2, 0.80)})}
    got = {v.metric: v for v in verdicts(summary, ["s", "absent"])}
    assert set(got) == {k for k, _, _ in METRICS}
    assert got["loss_med"].outcome == "wins" and got["loss_med"].best_method == "fedbuff"
    assert got["loss_med"].overlap is True  # 0.30 ± 0.01 meets 0.305 ± 0.01
    assert got["worst"].outcome == "loses" and got["worst"].best_method == "vanilla" and got["worst"].overlap is False
    assert got["acc"].outcome == "ties" and got["acc"].best == 0.90  # higher is better for accuracy
    assert verdicts({"s": _summary({"vanilla": (0.3, 1, 0.9)})}, ["s"]) == []  # no Rescaled(rate): no verdict


def test_every_run_is_a_runspec_of_the_population_model():
    rate, fedavg, fedbuff = BY_NAME["rescaled-rate"], BY_NAME["fedavg"], BY_NAME["fedbuff"]
    s = spec_for(Setting(0.1, 10), rate, 10.0, 2, 100.0, 5.0)
    assert (s.strategy, s.lr, s.seed, s.num_clients, s.dirichlet_alpha) == ("rescaled", 10.0, 2, 100, 0.1)
    assert s.options == {"by": "rate", "concurrency": 10}
    assert (s.delays, s.tau_profile, s.availability) == ("lognormal", "lognormal", "daily")
    assert s.partition == "mix" and s.resolved().task_config()["partition"] == "mix"  # the core's equal sizes
    assert "concurrency" not in spec_for(Setting(0.0, 100), rate, 10.0, 0, 100.0, 5.0).options  # C = N
    assert spec_for(Setting(0.0, 100), fedavg, 0.1, 0, 100.0, 5.0).options == {"concurrency": 50}
    assert fedavg_concurrency(Setting(0.0, 10)) == 10
    s = spec_for(Setting(0.0, 10), fedbuff, 0.3, 0, 100.0, 5.0)
    assert s.local_lr == 0.3 and s.lr is None and s.local_steps == MODEL["local_steps"]


def test_a_bad_flag_exits_with_status_2():
    from fl_rescaled.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["population", "--no-such-flag"])
    assert exc.value.code == 2


# ------------------------------------------------------------------------------ the quick study
@pytest.fixture(scope="module")
def study(mnist_cache, tmp_path_factory):
    from fl_rescaled.population import main

    out = tmp_path_factory.mktemp("population")
    rc = main(["--quick", "--out", str(out), "--no-progress"])
    return {"out": out, "rc": rc, "summary": json.loads((out / "summary.json").read_text()),
            "report": (out / "REPORT.md").read_text()}


def _table(out) -> dict[tuple[str, str], dict[str, str]]:
    with (out / "results.csv").open() as fh:
        return {(r["setting"], r["method"]): r for r in csv.DictReader(fh)}


@MNIST
def test_quick_study_runs_every_method_in_every_setting(study):
    assert study["rc"] == 0 and study["summary"]["failed"] == 0
    assert study["summary"]["computed"] == len(SETTINGS) * len(METHODS)
    table = _table(study["out"])
    assert set(table) == {(s.label, m.name) for s in SETTINGS for m in METHODS}
    for s in SETTINGS:
        for m in METHODS:
            row = table[(s.label, m.name)]
            rec = json.loads(next((study["out"] / "runs" / s.label / m.name).glob("*_seed0.json")).read_text())
            assert rec["study"]["setting"] == s.label and rec["strategy"] == m.strategy
            assert rec["num_clients"] == 100 and len(rec["client_losses"]) == 100
            assert float(row["final_loss_median"]) == pytest.approx(rec["final_loss"]) or rec["diverged"]
            assert rec["curve"]["time"][0] == 0 and len(rec["curve"]["accuracy"]) == 3
    for s in SETTINGS:
        assert (study["out"] / f"fig_{s.label}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from fl_rescaled.tasks.mnist import kernel_name  # (the kernel follows the CPU: the machine line names it)

    assert f"the MLP's products through {kernel_name()};" in study["report"]


def _listed(report: str, heading: str) -> set[tuple[str, str]]:
    """The (setting, metric) pairs a verdict section of the report lists."""
    section = report.split(heading, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^- `([^`]+)`, ([^:]+):", section, flags=re.M))


@MNIST
def test_report_verdicts_list_exactly_where_rate_rescaling_is_better_or_worse(study):
    report, table = study["report"], _table(study["out"])
    for heading in (TITLE, "## The population", "## The methods", "## Grids and choices", "## Results", NOT_WIN):
        assert heading in report, heading
    columns = {"loss_med": "final_loss_median", "worst": "worst_client_loss_median", "acc": "accuracy_median"}
    worse, better = set(), set()
    for s in SETTINGS:
        for key, what, lower in METRICS:
            def value(m):  # the median, oriented so that smaller is better
                v = float(table[(s.label, m)][columns[key]])
                return (v if lower else -v) if not math.isnan(v) else math.inf

            best_other = min(value(m.name) for m in METHODS if m.name != "rescaled-rate")
            mine = value("rescaled-rate")
            (worse if mine > best_other else better if mine < best_other else set()).add((s.label, what))
    assert _listed(report, NOT_WIN) == worse
    assert _listed(report, "## Where Rescaled(rate) wins") == better
    assert len(study["summary"]["verdicts"]) == len(SETTINGS) * len(METRICS)


@MNIST
def test_report_only_reuses_every_run_and_gives_the_same_verdicts(study):
    from fl_rescaled.population import main

    before = study["summary"]["verdicts"]
    assert main(["--quick", "--out", str(study["out"]), "--no-progress", "--report-only"]) == 0
    after = json.loads((study["out"] / "summary.json").read_text())
    assert after["computed"] == 0 and after["reused"] == len(SETTINGS) * len(METHODS)
    assert after["verdicts"] == before
