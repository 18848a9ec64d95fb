"""Checkpoint and resume: a run killed (SIGKILL) at a random point and resumed ends where the run that
was never interrupted ends, bit for bit (virtual clock); a restarted wall-clock run goes on from its
checkpoint; a corrupted or foreign checkpoint is refused with one line.

The kill: ``run_sim.py`` runs with an observer that SIGKILLs its own process at the first event at or
after a time drawn (per strategy, from a seed) between the first checkpoint and the budget, so the
kill lands mid-run on any machine; the test checks that it did (exit by SIGKILL, a checkpoint
before the budget, no final outputs) before it resumes.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

import hostile
from conftest import ROOT, run_of, run_sim, start_run
from fl_rescaled.runstate import Checkpointing, load
from fl_rescaled.strategies import RescaledASGD

QUAD = ["--task", "quadratic", "--taus", "1,2,3", "--quad-a", "1,2,1", "--quad-b", "0,3,-2", "--quad-dim", "4",
        "--noise", "0.2", "--delays", "exponential", "--lr", "0.05", "--budget", "6000", "--eval-every", "500",
        "--seed", "3"]
MNIST = ["--task", "mnist", "--delays", "exponential", "--lr", "1", "--budget", "320", "--eval-every", "40",
         "--seed", "1"]
STRATEGIES = {"rescaled": [], "malenia": [], "fedbuff": ["--fedbuff-buffer-size", "3"]}


def cli(*args: str) -> subprocess.CompletedProcess:
    return run_sim("--json", "--no-progress", *args)


def final_model(out: Path) -> np.ndarray:
    (npz,) = out.glob("*.npz")
    with np.load(npz) as z:
        return z["model"]


#: ``run_sim.py`` with an observer that SIGKILLs the process at its first event at or after
#: ``sys.argv[1]`` (time units); the rest of the arguments are ``run_sim.py``'s.
KILLED_AT = """
import os, signal, sys
from fl_rescaled import cli, experiment
from fl_rescaled.manager import ManagerObserver

at = float(sys.argv[1])


class KillAt(ManagerObserver):
    def handled(self, comp, x):
        if comp.time >= at:
            os.kill(os.getpid(), signal.SIGKILL)


run = experiment.run
experiment.run = lambda spec, *a, **k: run(spec, *a, observers=[KillAt()], **k)
sys.exit(cli.main(sys.argv[2:]))
"""


def kill_time(strategy: str, every: float, budget: float) -> float:
    """Where a run of ``strategy`` is killed: drawn from a seed of its own, between its first
    checkpoint and the last tenth of its budget."""
    return random.Random(zlib.crc32(strategy.encode())).uniform(every, 0.9 * budget)


def checkpoint_time(ckpt: Path) -> float:
    """The clock time a run checkpoint was written at (its state, read as data)."""
    with zipfile.ZipFile(io.BytesIO(ckpt.read_bytes())) as zf:
        manager = json.loads(zf.read("state.json"))["run"]["manager"]
    return float((manager["virtual"] or manager["wall"])["now"])


def killed_then_resumed(args: list[str], folder: Path, every: float, at: float, budget: float
                        ) -> subprocess.CompletedProcess:
    """Run with checkpoints every ``every`` time units, SIGKILLed at its first event at or after ``at``;
    check that the kill landed mid-run; then run the same command with ``--resume``."""
    flags = [*args, "--out", str(folder), "--checkpoint-every", f"{every:g}"]
    killed = subprocess.run([sys.executable, "-c", KILLED_AT, repr(at), "--json", "--no-progress", *flags],
                            capture_output=True, text=True, cwd=ROOT)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    # The kill landed mid-run: a checkpoint from before the kill, and none of the final outputs.
    assert every <= checkpoint_time(folder / "run.ckpt") <= at < budget
    assert not [p.name for p in folder.iterdir() if p.suffix in (".npz", ".csv", ".png")]
    return cli(*flags, "--resume", str(folder))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_quadratic_run_killed_and_resumed_ends_bit_for_bit_where_it_would_have(tmp_path, strategy):
    args = [*QUAD, "--strategy", strategy, *STRATEGIES[strategy]]
    ref = cli(*args, "--out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    res = killed_then_resumed(args, tmp_path / "killed", 400, kill_time(strategy, 400, 6000), 6000)
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
    res = killed_then_resumed(args, tmp_path / "killed", 40, kill_time(strategy, 40, 320), 320)
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


class Evil:
    """Unpickling this would run a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def hostile_checkpoints(good: bytes, marker: Path) -> dict[str, bytes]:
    """Files an attacker could put in place of a run's checkpoint, each trying to run a command."""
    import io
    import pickle
    import zipfile

    evil = pickle.dumps(Evil(marker), protocol=4)
    # Protocol 4 reaches os.system through a module attribute (the hole the old unpickler had).
    def short(text: str) -> bytes:
        return b"\x8c" + bytes([len(text)]) + text.encode() + b"\x94"

    dotted = b"\x80\x04" + short("fl_rescaled.checkpoints") + short("os.system") + b"\x93\x94" \
        + short(f"touch {marker}") + b"\x85\x94R\x94."
    header = {"format": 1, "fingerprint": "x", "bytes": len(evil), "sha256": "0" * 64}
    out = {"a raw pickle": evil, "a dotted-name pickle": dotted,
           "the old format (a pickle)": b"fl-rescaled run state\n" + json.dumps(header).encode() + b"\n" + evil}
    obj = io.BytesIO()
    np.save(obj, np.array([Evil(marker)], dtype=object), allow_pickle=True)
    with zipfile.ZipFile(io.BytesIO(good)) as zf:
        members = {i.filename: zf.read(i.filename) for i in zf.infolist()}

    def rezip(**changes: bytes | None) -> bytes:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
            for name, data in {**members, **changes}.items():
                if data is not None:
                    zf.writestr(name, data)
        return buf.getvalue()

    out["an object array in place of the model"] = rezip(**{"arrays/0.npy": obj.getvalue()})
    out["an extra member holding a pickle"] = rezip(**{"payload.pkl": evil})
    out["a pickle in place of the state"] = rezip(**{"state.json": evil})
    deflated = io.BytesIO()
    with zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    out["compressed members"] = deflated.getvalue()
    out["an npz of numpy's own (np.savez)"] = _savez(model=np.zeros(3), evil=np.array([Evil(marker)], dtype=object))
    return out


def _savez(**arrays) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def test_a_checkpoint_replaced_by_a_pickle_is_refused_with_exit_2_and_runs_nothing(tmp_path):
    """State is data: a checkpoint is JSON and .npy arrays in a zip, read without unpickling or
    importing anything. Every hostile file is refused with one line and exit status 2, and the
    command it carries never runs."""
    args = [*QUAD, "--strategy", "rescaled", "--budget", "600"]
    first = cli(*args, "--out", str(tmp_path), "--checkpoint-every", "100")
    assert first.returncode == 0, first.stderr
    ckpt = tmp_path / "run.ckpt"
    good = ckpt.read_bytes()
    marker = tmp_path / "pwned"
    for what, data in hostile_checkpoints(good, marker).items():
        ckpt.write_bytes(data)
        r = cli(*args, "--resume", str(tmp_path))
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "run.ckpt" in lines[0], (what, r.stderr)
        assert not marker.exists(), f"{what}: the command ran"
    ckpt.write_bytes(good)
    assert cli(*args, "--resume", str(tmp_path)).returncode == 0  # the genuine one still works


def test_a_file_that_does_not_match_the_schema_is_refused_naming_the_field(tmp_path):
    """Well-formed data of the wrong shape (a field missing, a count of the wrong type, arrays that do
    not fit the run) is refused with one line naming what is wrong, never half-loaded."""
    import io
    import zipfile

    args = [*QUAD, "--strategy", "malenia", "--budget", "600"]
    assert cli(*args, "--out", str(tmp_path), "--checkpoint-every", "100").returncode == 0
    ckpt = tmp_path / "run.ckpt"
    good = ckpt.read_bytes()
    with zipfile.ZipFile(io.BytesIO(good)) as zf:
        members = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    state = json.loads(members["state.json"])

    def refused_with(tree, why: str) -> None:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            for name, data in {**members, "state.json": json.dumps(tree).encode()}.items():
                zf.writestr(name, data)
        ckpt.write_bytes(buf.getvalue())
        r = cli(*args, "--resume", str(tmp_path))
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and why in lines[0], r.stderr

    bad = json.loads(json.dumps(state))
    del bad["run"]["consecutive"]
    refused_with(bad, "missing field 'consecutive'")
    bad = json.loads(json.dumps(state))
    bad["run"]["manager"]["next_job_id"] = "7"
    refused_with(bad, "next_job_id: expected an integer")
    bad = json.loads(json.dumps(state))
    bad["run"]["manager"]["books"]["n"] = 99
    refused_with(bad, "books")
    bad = json.loads(json.dumps(state))
    bad["algorithm"]["B"] = bad["algorithm"]["G"]  # Malenia's counts replaced by its sums
    refused_with(bad, "Malenia")
    ckpt.write_bytes(good)
    assert cli(*args, "--resume", str(tmp_path)).returncode == 0


def test_a_run_killed_while_writing_leaves_no_temporary_file_behind(tmp_path):
    from fl_rescaled.checkpoints import remove_stale_temporaries

    stale = tmp_path / ".run.ckpt.abc123.tmp"  # what a kill -9 during a write leaves
    stale.write_bytes(b"half a checkpoint")
    args = [*QUAD, "--strategy", "rescaled", "--budget", "300"]
    assert cli(*args, "--out", str(tmp_path), "--checkpoint-every", "100").returncode == 0
    assert not stale.exists() and (tmp_path / "run.ckpt").exists()
    stale.write_bytes(b"again")
    remove_stale_temporaries(tmp_path / "run.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.slow
def test_a_wall_clock_run_resumes_from_its_checkpoint_and_loses_only_the_jobs_in_flight(tmp_path):
    args = ["--task", "quadratic", "--strategy", "rescaled", "--taus", "1,2,4", "--quad-a", "1,1,1",
            "--quad-b", "0,3,6", "--lr", "0.05", "--budget", "300", "--clock", "wall", "--emulate", "fixed",
            "--time-unit", "0.02", "--eval-every", "50"]
    folder = tmp_path / "wall"
    # Killed at its first event after 150 of its 300 time units (two checkpoints, at 60 and 120).
    res = killed_then_resumed(args, folder, 60, 150.0, 300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["final_time"] == pytest.approx(300, abs=1)  # the clock went on from the checkpoint's time
    assert out["rejected"].get("resumed", 0) >= 1  # the jobs in flight at the checkpoint were lost
    assert sum(out["lost_per_worker"]) == out["rejected"]["resumed"]  # and nothing else was
    assert abs(out["final_params"][0] - 3.0) < 0.3  # Rescaled ASGD's equal-weight point


def test_a_run_with_estimated_delivery_periods_resumes_with_its_tau_table(tmp_path):
    """C = 2 of 4 workers on the virtual clock: the τ table (each worker's mean time between
    deliveries) is estimated during the run, so it is part of the state. The run resumed from its
    last checkpoint goes on with the table it had, not the starting prior, and ends bit for bit
    where the uninterrupted one did."""
    def start(resume: bool):
        s = RescaledASGD(concurrency=2, lr=0.5)
        plan = Checkpointing(tmp_path / "run.ckpt", 50.0, "taus-test", resume=resume)
        res = start_run(s, hostile.HostileGrid(), ArrayRecord({"w": Array(np.zeros(hostile.DIM, np.float32))}),
                      time_budget=180.0, clock=hostile.VirtualClock(hostile.DelayModel(hostile.TAUS)),
                      train_config={"reply": "gradient"}, partition_query=True, checkpoint=plan)
        return s, res

    first, res1 = start(False)
    manager = run_of(first).manager
    saved = load(Checkpointing(tmp_path / "run.ckpt", 50.0, "taus-test").covering(
        first, run_of(first).layout, 180.0, None), first.State).manager
    assert manager.source.periods_how and 50.0 <= saved.virtual.now < 180.0
    assert saved.virtual.periods != list(manager.periods.prior)  # (the table learned something before the checkpoint)
    second, res2 = start(True)
    assert res2.arrays["w"].numpy().tobytes() == res1.arrays["w"].numpy().tobytes()
    assert list(run_of(second).manager.periods.taus) == list(manager.periods.taus)
