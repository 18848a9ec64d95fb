"""The command line refuses runs that cannot end or cannot update, says when a run did nothing
useful, warns about flags that change nothing, and keeps every run's files apart (issue 21, items
3, 4 and 6).

Most cases run in process through ``cli.main`` (the quadratic task, small budgets); the resume
tests run ``run_sim.py`` in a subprocess, killed with SIGKILL as in ``tests/test_checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, run_sim
from test_checkpoint import KILLED_AT  # (run_sim.py SIGKILLed at its first event at or after a time)
from fl_rescaled import RunFailed, cli
from fl_rescaled.experiment import RunSpec, run

QUAD = ["--task", "quadratic", "--no-progress", "--workers", "1"]


def main(*argv: str) -> tuple[int, str, str]:
    """``cli.main(argv)``: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


# ---------------------------------------------------------------------------------- refused at start
@pytest.mark.parametrize("argv,why", [
    # more than 1e9 replies: the run would not end (these hung)
    (["--budget", "1e300"], "would not end"),
    (["--budget", "1e308"], "would not end"),
    (["--taus", "1e-300,1"], "would not end"),
    (["--taus", "1e-300,1", "--strategy", "delay-adaptive"], "would not end"),
    (["--taus", "1e-300,1", "--delays", "exponential"], "would not end"),
    (["--taus", "1,2", "--budget", "1e6", "--speed-drift", "-1"], "would not end"),  # jobs down to 1/1000 of τ
    (["--taus", "1,2", "--budget", "1e8", "--jobs-per-node", "1000"], "would not end"),
    # a wall-clock budget outside a millisecond .. a year (1e-300 hung evaluating 1e293 points)
    (["--clock", "wall", "--time-unit", "1e300"], "a year"),
    (["--clock", "wall", "--time-unit", "1e-300"], "a year"),
    # no update can come within the budget (these ran, returned the initial model and exited 0)
    (["--budget", "5e-324"], "too small"),  # (a traceback: eval_every must be positive)
    (["--budget", "0.5"], "no reply can arrive"),
    (["--strategy", "fedbuff", "--fedbuff-buffer-size", "1000000"], "allows at most 38,750"),
    (["--strategy", "fedbuff", "--taus", "1,2", "--budget", "10", "--fedbuff-buffer-size", "16"], "at most 15"),
    (["--strategy", "malenia", "--malenia-s", "1e300"], "harmonic mean"),
    (["--strategy", "malenia", "--taus", "1,2", "--budget", "10", "--malenia-s", "14"], "harmonic mean"),
    (["--strategy", "malenia", "--budget", "10"], "the slowest"),  # τ = 16 delivers nothing by t = 10
    # waits for nodes that never come; files and speeds checked before the run
    (["--min-available-nodes", "11"], "--min-available-nodes"),
    (["--speed-switch", "0,-1"], "--speed-switch"),
    (["--delays", "trace", "--delay-trace", "/nonexistent/trace.csv"], "--delay-trace"),
    (["--availability", "trace", "--availability-trace", "/nonexistent/trace.json"], "--availability-trace"),
    # a failure check so large that it is off
    (["--max-consecutive-rejections", "99999999999999999999"], "at most 1,000,000"),
])
def test_a_run_that_cannot_end_or_cannot_update_is_refused_before_it_starts(argv, why):
    code, out, err = main(*QUAD, *argv)
    assert code == 2 and len(lines(err)) == 1 and why in err and "error" in err, (argv, code, err)
    assert out == ""  # refused before anything ran


@pytest.mark.parametrize("argv", [
    ["--strategy", "fedbuff", "--taus", "1,2", "--budget", "10", "--fedbuff-buffer-size", "14"],
    ["--strategy", "malenia", "--taus", "1,2", "--budget", "10", "--malenia-s", "10"],
    ["--strategy", "vanilla", "--taus", "1,2", "--budget", "1"],  # (the reply at t = 1 = the budget counts)
])
def test_the_same_settings_just_within_reach_run_and_update(argv):
    code, out, err = main(*QUAD, *argv, "--json")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["num_updates"] >= 1


# ---------------------------------------------------------------------------------- did nothing useful
def test_a_run_with_zero_updates_fails_with_one_line_and_exit_1():
    # Exponential compute times: the 100 replies FedBuff needs could come in 30 units; they did not.
    argv = ["--strategy", "fedbuff", "--fedbuff-buffer-size", "100", "--delays", "exponential", "--taus", "1,2",
            "--budget", "30"]
    code, _, err = main(*QUAD, *argv)
    assert code == 1 and len(lines(err)) == 1, err
    assert "applied no update" in err and "replies accepted" in err
    with pytest.raises(RunFailed, match="applied no update") as info:  # (the same from Python)
        run(RunSpec(task="quadratic", strategy="fedbuff", options={"buffer_size": 100}, delays="exponential",
                    taus=[1.0, 2.0], budget=30.0))
    assert info.value.books["updates"] == 0 and info.value.books["balanced"] == 1


def test_a_client_whose_replies_were_all_rejected_is_named_and_the_table_counts_rejections():
    # Two evaluation points after the start: the objective, which client 0's curvature of 1e308 dominates,
    # explodes as the model leaves client 0's optimum, and three points in a row above 10 × the start
    # would stop the run as diverged (fl_rescaled.divergence).
    code, out, err = main(*QUAD, "--taus", "1,2", "--quad-a", "1e308,1", "--quad-b", "0,1", "--budget", "50",
                          "--eval-every", "25")
    assert code == 0, err
    named = [ln for ln in lines(err) if "client 0: all" in ln]
    assert [ln.split(":")[2].strip() for ln in named] == ["rescaled", "vanilla"]
    assert all("replies were rejected (non-finite: " in ln for ln in named)
    assert not any("client 1" in ln for ln in lines(err))
    table = lines(out)
    head = next(ln for ln in table if ln.startswith("strategy"))
    end = head.index("rejected") + len("rejected")  # (a right-aligned column)
    rows = table[table.index(head) + 2:table.index(head) + 4]
    assert [int(row[end - 9:end]) for row in rows] == [int(ln.split("all ")[1].split()[0]) for ln in named]


# ---------------------------------------------------------------------------------- flags that change nothing
@pytest.mark.parametrize("argv,flag", [
    (["--task", "mnist", "--quad-a", "1,2"], "--quad-a"),
    (["--task", "quadratic", "--dirichlet-alpha", "0.5"], "--dirichlet-alpha"),
    (["--task", "quadratic", "--time-unit", "0.5"], "--time-unit"),
    (["--task", "quadratic", "--clock", "wall", "--workers", "2"], "--workers"),
    (["--task", "quadratic", "--delay-sigma", "2"], "--delay-sigma"),
    (["--task", "quadratic", "--strategy", "rescaled", "--local-steps", "3"], "--local-steps"),
    (["--task", "quadratic", "--taus", "1,2", "--tau-profile", "uniform"], "--tau-profile"),
])
def test_a_flag_that_does_not_apply_warns_in_one_line(argv, flag):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        cli.parse(argv)
    assert lines(err.getvalue()) == [ln for ln in lines(err.getvalue()) if ln.startswith("run_sim.py: warning:")]
    assert [ln for ln in lines(err.getvalue()) if f"{flag} is ignored" in ln], err.getvalue()


@pytest.mark.parametrize("argv", [
    ["--task", "quadratic", "--quad-a", "1,2", "--taus", "1,2"],
    ["--task", "quadratic", "--clock", "wall", "--time-unit", "0.5"],
    ["--task", "quadratic", "--delays", "lognormal", "--delay-sigma", "2"],
    ["--task", "quadratic", "--strategy", "fedbuff", "--local-steps", "3"],  # (model replies)
    ["--task", "quadratic", "--strategy", "all", "--local-steps", "3"],  # (applies to some of them)
])
def test_a_flag_that_applies_says_nothing(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        cli.parse(argv)
    assert err.getvalue() == ""


# ---------------------------------------------------------------------------------- files
def test_out_naming_a_file_is_refused_before_any_work(tmp_path):
    (tmp_path / "f").write_text("")
    for out, why in ((tmp_path / "f", "is a file"), (tmp_path / "f" / "sub", "cannot create")):
        code, stdout, err = main(*QUAD, "--out", str(out))
        assert code == 2 and len(lines(err)) == 1 and why in err, err
        assert stdout == ""
    code, _, err = main(*QUAD, "--budget", "20", "--strategy", "vanilla", "--out", str(tmp_path / "a" / "b"))
    assert code == 0 and (tmp_path / "a" / "b").is_dir(), err  # (created, parents too)


def test_runs_that_differ_in_any_setting_write_different_files(tmp_path):
    runs = [["--lr", "0.05"], ["--lr", "0.01"], ["--lr", "0.05", "--budget", "40"], ["--lr", "0.123456789"]]
    for extra in runs:
        code, _, err = main(*QUAD, "--strategy", "rescaled", "--taus", "1,2", "--budget", "20", *extra,
                            "--out", str(tmp_path))
        assert code == 0, err
    models = sorted(p.name for p in tmp_path.glob("*.npz"))
    assert len(models) == len(runs), models
    assert [m for m in models if "_lr0.123456789_" in m]  # α with every digit
    meta = [json.loads(p.read_text()) for p in tmp_path.glob("quadratic_rescaled_lr0.05_*.json")]
    assert sorted(m["settings"]["budget"] for m in meta) == [20.0, 40.0]  # the JSON carries every setting


RESUMABLE = [*QUAD, "--json", "--taus", "1,2,3", "--quad-b", "0,3,-2", "--delays", "exponential", "--lr", "0.05",
             "--budget", "600", "--eval-every", "50", "--seed", "3"]


def models(folder: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(folder.glob("*.npz")):
        with np.load(p) as z:
            out[p.name] = z["model"].tobytes()
    return out


def test_the_default_comparison_killed_and_resumed_with_the_same_command_ends_where_it_would_have(tmp_path):
    ref = run_sim(*RESUMABLE, "--out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    folder = tmp_path / "killed"
    flags = [*RESUMABLE, "--out", str(folder), "--checkpoint-every", "100"]
    # Killed during the first strategy (rescaled): it has a checkpoint, vanilla none.
    killed = subprocess.run([sys.executable, "-c", KILLED_AT, "350", *flags], capture_output=True, text=True,
                            cwd=ROOT)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["run-rescaled.ckpt"]
    for _ in range(2):  # resumed; then the same command again, with both checkpoints there
        res = run_sim(*flags, "--resume", str(folder))
        assert res.returncode == 0, res.stderr
        assert sorted(p.name for p in folder.glob("*.ckpt")) == ["run-rescaled.ckpt", "run-vanilla.ckpt"]
        assert models(folder) == models(tmp_path / "ref") and len(models(folder)) == 2


def test_every_strategy_keeps_its_own_checkpoint_and_resumes_with_the_same_command(tmp_path):
    flags = [*RESUMABLE, "--strategy", "all", "--budget", "200", "--out", str(tmp_path), "--checkpoint-every",
             "60"]
    first = run_sim(*flags)
    assert first.returncode == 0, first.stderr
    names = [o["strategy"] for o in json.loads(first.stdout.splitlines()[-1])]
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == sorted(f"run-{n}.ckpt" for n in names)
    done = models(tmp_path)
    assert len(done) == len(names)
    again = run_sim(*flags, "--resume", str(tmp_path))  # each from its own last checkpoint (t = 180)
    assert again.returncode == 0, again.stderr
    assert models(tmp_path) == done
