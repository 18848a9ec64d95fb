"""Checkpoint and resume: a run killed (SIGKILL) at a random point and resumed ends where the run that
was never interrupted ends, bit for bit (virtual clock); a restarted wall-clock run goes on from its
checkpoint; a corrupted or foreign checkpoint is refused with one line."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT

QUAD = ["--task", "quadratic", "--taus", "1,2,3", "--quad-a", "1,2,1", "--quad-b", "0,3,-2", "--quad-dim", "4",
        "--noise", "0.2", "--delays", "exponential", "--lr", "0.05", "--budget", "6000", "--eval-every", "500",
        "--seed", "3"]
MNIST = ["--task", "mnist", "--delays", "exponential", "--lr", "1", "--budget", "320", "--eval-every", "40",
         "--seed", "1"]
STRATEGIES = {"rescaled": [], "malenia": [], "fedbuff": ["--fedbuff-buffer-size", "3"]}


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "run_sim.py"), "--json", "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def final_model(out: Path) -> np.ndarray:
    (npz,) = out.glob("*.npz")
    with np.load(npz) as z:
        return z["model"]


def killed_then_resumed(args: list[str], folder: Path, every: str, seed: int) -> subprocess.CompletedProcess:
    """Start the run with checkpoints, SIGKILL it at a random moment after its first checkpoint,
    then run the same command with ``--resume``."""
    ckpt = folder / "run.ckpt"
    cmd = [sys.executable, str(ROOT / "run_sim.py"), "--json", "--no-progress", *args, "--out", str(folder),
           "--checkpoint-every", every]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(random.Random(seed).uniform(0.0, 0.6))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ckpt.exists(), "the run was killed before its first checkpoint"
    for stale in folder.glob("*.npz"):  # (a run that finished before the kill): resume must redo the end
        stale.unlink()
    return cli(*args, "--out", str(folder), "--checkpoint-every", every, "--resume", str(folder))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_quadratic_run_killed_and_resumed_ends_bit_for_bit_where_it_would_have(tmp_path, strategy):
    args = [*QUAD, "--strategy", strategy, *STRATEGIES[strategy]]
    ref = cli(*args, "--out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    res = killed_then_resumed(args, tmp_path / "killed", "400", seed=len(strategy))
    assert res.returncode == 0, res.stderr
    np.testing.assert_array_equal(final_model(tmp_path / "killed"), final_model(tmp_path / "ref"))
    a, b = json.loads(ref.stdout.splitlines()[-1]), json.loads(res.stdout.splitlines()[-1])
    assert (a["num_updates"], a["updates_per_worker"], a["final_loss"]) == (b["num_updates"], b["updates_per_worker"],
                                                                           b["final_loss"])


@pytest.mark.slow
@pytest.mark.mnist
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_an_mnist_run_killed_and_resumed_ends_bit_for_bit_where_it_would_have(mnist_cache, tmp_path, strategy):
    args = [*MNIST, "--strategy", strategy, *STRATEGIES[strategy]]
    ref = cli(*args, "--out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    res = killed_then_resumed(args, tmp_path / "killed", "40", seed=len(strategy) + 1)
    assert res.returncode == 0, res.stderr
    np.testing.assert_array_equal(final_model(tmp_path / "killed"), final_model(tmp_path / "ref"))


def test_a_corrupted_or_foreign_checkpoint_is_refused_with_one_line(tmp_path):
    args = [*QUAD, "--strategy", "rescaled", "--budget", "600"]
    first = cli(*args, "--out", str(tmp_path), "--checkpoint-every", "100")
    assert first.returncode == 0, first.stderr
    ckpt = tmp_path / "run.ckpt"
    good = ckpt.read_bytes()

    def refused(*extra: str, why: str) -> None:
        r = cli(*args, *extra, "--resume", str(tmp_path))
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and why in lines[0], r.stderr

    refused("--lr", "0.1", why="belongs to another run")  # other settings
    refused("--strategy", "vanilla", why="belongs to another run")
    ckpt.write_bytes(good[:-10] + bytes(b ^ 0xFF for b in good[-10:]))
    refused(why="corrupted")
    ckpt.write_bytes(good[: len(good) // 2])
    refused(why="corrupted")
    ckpt.write_bytes(b"not a checkpoint at all")
    refused(why="not an fl-rescaled run checkpoint")
    ckpt.unlink()
    refused(why="no checkpoint")
    ckpt.write_bytes(good)
    assert cli(*args, "--resume", str(tmp_path)).returncode == 0  # the intact one still works


def test_a_checkpoint_only_unpickles_what_a_run_state_contains(tmp_path):
    import hashlib
    import pickle

    from fl_rescaled.checkpoints import CheckpointError, read_state, write_state

    path = write_state(tmp_path / "x.ckpt", {"ok": np.arange(3)}, "fp")
    assert read_state(path, "fp")["ok"].tolist() == [0, 1, 2]
    with pytest.raises(CheckpointError, match="another run"):
        read_state(path, "other")

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    payload = pickle.dumps(Evil())
    header = {"format": 1, "fingerprint": "fp", "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    evil = tmp_path / "evil.ckpt"
    evil.write_bytes(b"fl-rescaled run state\n" + json.dumps(header).encode() + b"\n" + payload)
    with pytest.raises(CheckpointError, match="never contains"):
        read_state(evil, "fp")  # a well-formed checkpoint that would run a command is still refused


@pytest.mark.slow
def test_a_wall_clock_run_resumes_from_its_checkpoint_and_loses_only_the_jobs_in_flight(tmp_path):
    args = ["--task", "quadratic", "--strategy", "rescaled", "--taus", "1,2,4", "--quad-a", "1,1,1",
            "--quad-b", "0,3,6", "--lr", "0.05", "--budget", "300", "--clock", "wall", "--emulate", "fixed",
            "--time-unit", "0.02", "--eval-every", "50"]
    folder = tmp_path / "wall"
    proc = subprocess.Popen([sys.executable, str(ROOT / "run_sim.py"), "--json", "--no-progress", *args,
                             "--out", str(folder), "--checkpoint-every", "60"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (folder / "run.ckpt").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    res = cli(*args, "--out", str(folder), "--checkpoint-every", "60", "--resume", str(folder))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["final_time"] == pytest.approx(300, abs=1)  # the clock went on from the checkpoint's time
    assert out["rejected"].get("resumed", 0) >= 1  # the jobs in flight at the checkpoint were lost
    assert sum(out["lost_per_worker"]) == out["rejected"]["resumed"]  # and nothing else was
    assert abs(out["final_params"][0] - 3.0) < 0.3  # Rescaled ASGD's equal-weight point
