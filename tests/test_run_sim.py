"""The command line: validation, JSON output, and a short real-MNIST run that learns."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, TOY1_EQUAL, TOY1_FLAGS, run_sim as cli

REQUIRED = {"strategy", "lr", "budget", "final_time", "num_updates", "updates_per_worker", "final_loss",
            "final_params", "wall_seconds"}


@pytest.mark.parametrize("args", [
    ["--taus", "1,0"],
    ["--taus", "1,-2"],
    ["--lr", "0"],
    ["--lr", "-1"],
    ["--taus", "1,2", "--num-clients", "3"],
    ["--task", "quadratic", "--quad-a", "1,2", "--quad-b", "1,2,3", "--taus", "1,2"],
    ["--rescaled-weights", "0.5,0.6", "--taus", "1,2"],
    ["--strategy", "rescaled", "--fedbuff-buffer-size", "3"],  # an option of a strategy not in the run
    ["--fedbuff-buffer-size", "x", "--strategy", "fedbuff"],
    ["--strategy", "nope"],
    ["--task", "cifar"],
    ["--delays", "gamma"],
    ["--taus", "a,b"],
    ["--budget", "0"],
    ["--unknown-flag"],
])
def test_bad_input_exits_2_with_one_line(args):
    r = cli(*args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "error" in lines[0]


def test_json_quadratic():
    r = cli("--task", "quadratic", "--strategy", "rescaled", *TOY1_FLAGS, "--lr", "0.01", "--budget", "3000", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert REQUIRED <= set(out)
    assert out["updates_per_worker"] == [3000, 1500] and out["num_updates"] == 4500
    assert abs(out["final_params"][0] - TOY1_EQUAL) < 0.05
    assert out["final_time"] == 3000


def test_seeds_run_each_seed_as_seed_does_and_end_with_their_median_and_range():
    """``--seeds 0,1,2``: each run is the ``--seed`` run of that seed (same trajectory), and the
    summary gives each strategy's median and min-max over them (exponential delays: the seeds differ)."""
    flags = ["--task", "quadratic", *TOY1_FLAGS, "--lr", "0.01", "--budget", "300", "--delays", "exponential"]
    r = cli(*flags, "--seeds", "0,1,2", "--json")
    assert r.returncode == 0, r.stderr
    runs = json.loads(r.stdout.splitlines()[-1])
    assert [(o["strategy"], o["seed"]) for o in runs] == [(n, s) for s in (0, 1, 2) for n in ("rescaled", "vanilla")]
    one = json.loads(cli(*flags, "--seed", "1", "--strategy", "vanilla", "--json").stdout.splitlines()[-1])
    assert one["final_params"] == runs[3]["final_params"] and one["final_loss"] == runs[3]["final_loss"]
    losses = sorted(o["final_loss"] for o in runs if o["strategy"] == "rescaled")
    assert len(set(losses)) == 3  # (three different runs)
    out = r.stdout.splitlines()
    top = out.index(next(line for line in out if line.startswith("3 seeds (0, 1, 2): median [min - max]")))
    row = next(line for line in out[top:] if line.startswith("rescaled"))
    assert row.split()[1:5] == [f"{losses[1]:.4g}", f"[{losses[0]:.4g}", "-", f"{losses[2]:.4g}]"]
    assert "rescaled (seed 2)" in r.stdout  # (each run's row says its seed)
    bad = cli(*flags, "--seeds", "1", "--seed", "2")
    assert bad.returncode == 2 and "give --seed or --seeds, not both" in bad.stderr


def test_verbose_log_is_flowers_each_line_once():
    """``-v``: the strategies' INFO lines go through Flower's own logger and handler, once each (no
    second copy in another format), drawn as FedAvg's summary and results."""
    r = cli("--task", "quadratic", "--strategy", "rescaled", *TOY1_FLAGS, "--lr", "0.01", "--budget", "40", "-v")
    assert r.returncode == 0, r.stderr
    lines = (r.stdout + r.stderr).splitlines()
    for text in ("Starting RescaledASGD strategy:", "├──> Options:", "└──> Keys in records:", "Final results:"):
        assert sum(text in line for line in lines) == 1, text
    assert not [line for line in lines if "flwr.fl_rescaled:" in line or "WARNING" in line]


def test_outputs_written(tmp_path):
    r = cli("--task", "quadratic", "--strategy", "vanilla", *TOY1_FLAGS, "--lr", "0.01", "--budget", "200",
            "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    (csv,) = tmp_path.glob("quadratic_vanilla_lr0.01_seed0_????????.csv")  # (then 8 hex digits of the settings)
    stem = csv.stem
    assert len(stem.rsplit("_", 1)[1]) == 8
    csvs, pngs = list(tmp_path.glob(f"{stem}.csv")), list(tmp_path.glob(f"{stem}.png"))
    assert len(csvs) == 1 and len(pngs) == 1 and pngs[0].stat().st_size > 1000
    extra = {p.name for p in tmp_path.glob(f"{stem}_*")}
    assert extra == {f"{stem}_timeline.png", f"{stem}_staleness.png", f"{stem}_clients.csv"}
    assert {p.name for p in tmp_path.glob(f"{stem}.*")} == {f"{stem}.{ext}" for ext in ("csv", "png", "npz", "json")}
    assert len((tmp_path / f"{stem}_clients.csv").read_text().splitlines()) == 1 + 2  # one row per client
    header = csvs[0].read_text().splitlines()[0].split(",")
    for col in ("time", "updates", "loss", "cumulative_stepsize", "updates_per_worker"):
        assert col in header
    assert len(csvs[0].read_text().splitlines()) == 1 + 201  # evaluations at 0, 1, ..., 200


@pytest.mark.mnist
def test_short_mnist_run_lowers_training_loss(mnist_cache, tmp_path):
    r = cli("--strategy", "rescaled", "--budget", "300", "--lr", "3", "--eval-every", "50", "--json",
            "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    (csv,) = tmp_path.glob("mnist_rescaled_lr3_seed0_????????.csv")
    rows = csv.read_text().splitlines()
    header = rows[0].split(",")
    losses = [float(row.split(",")[header.index("loss")]) for row in rows[1:]]
    assert losses[0] > 2.0  # untrained: about ln 10
    assert out["final_loss"] < 0.7 * losses[0]
    assert losses == sorted(losses, reverse=True) or losses[-1] < min(losses[:2])
    assert out["accuracy"] > 0.5
    assert out["num_updates"] == 2 * (300 + 150 + 75 + 37 + 18)


@pytest.mark.mnist
def test_more_clients_than_the_data_can_split_is_refused_before_the_run(mnist_cache):
    r = cli("--num-clients", "70000", "--concurrency", "100", "--budget", "5")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "70000 clients" in lines[0] and "quadratic" in lines[0], r.stderr
    assert "70,000 clients" in r.stdout and len(r.stdout) < 1000  # the log line summarises the τ


def test_a_population_of_100000_clients_runs_from_the_command_line():
    r = cli("--task", "quadratic", "--strategy", "rescaled", "--num-clients", "100000", "--concurrency", "1000",
            "--budget", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    books = out["books"]
    assert out["num_clients"] == 100000 and books["balanced"] == 1 and books["in-flight"] == 1000
    assert 600 < out["num_updates"] == books["replies-accepted"]  # ≈ C · budget / mean τ = 1000 · 8 / 6.2


def test_checkpoint_roundtrip(tmp_path):
    import numpy as np

    from fl_rescaled.checkpoints import load_model, save_model

    x = np.linspace(-1, 1, 11, dtype=np.float32)
    save_model(tmp_path / "run", x, {"strategy": "rescaled", "history": [1, 2]})
    y, meta = load_model(tmp_path / "run")
    assert y.tobytes() == x.tobytes() and meta["strategy"] == "rescaled" and "history" not in meta
    (tmp_path / "run.json").write_text((tmp_path / "run.json").read_text().replace('"model_size": 11', '"model_size": 12'))
    with pytest.raises(ValueError):
        load_model(tmp_path / "run")


def test_importing_the_package_keeps_flower_and_ray_offline_unless_the_user_says_otherwise():
    import os

    from fl_rescaled import OFFLINE_ENV

    probe = ("import fl_rescaled, os; from flwr.supercore import telemetry; "
             "print(telemetry.FLWR_TELEMETRY_ENABLED, os.environ['FLWR_DISABLE_UPDATE_CHECK'], "
             "os.environ['RAY_USAGE_STATS_ENABLED'])")
    bare = {k: v for k, v in os.environ.items() if k not in OFFLINE_ENV}

    def seen(env):
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                              env=env, check=True).stdout.split()

    assert seen(bare) == ["0", "1", "0"]  # Flower read the default when fl_rescaled imported it
    assert seen({**bare, "FLWR_TELEMETRY_ENABLED": "1"}) == ["1", "1", "0"]  # the user's choice stands


def test_every_public_name_resolves():
    import fl_rescaled

    missing = [name for name in fl_rescaled.__all__ if not hasattr(fl_rescaled, name)]
    assert missing == []
    assert fl_rescaled.RescaledASGD.name == "rescaled"
