"""Who trains next in a population (C < N): the selection seam (``fl_rescaled.manager.selection``).

* ``uniform`` (the default) and ``round-robin`` are the built-in selections. Round-robin gives every
  client its turn once per cycle; the uniform draw does so only on average.
* Neither picks a busy or an offline client.
* A selector of one's own plugs in by name, as a stepsize rule does.
* The selection is part of the run: seeded, written into checkpoints as data (a resumed run ends bit
  for bit where it would have), and checked when a run is resumed. A tampered order is refused.
"""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest

from conftest import quad
from fl_rescaled.experiment import RunSpec, run, virtual_clock
from fl_rescaled.manager import SELECTORS, IdleSelector
from fl_rescaled.strategies import STRATEGIES
from test_checkpoint import cli, final_model, killed_then_resumed
from test_population import InFlight

POPULATION = dict(task="quadratic", num_clients=20, taus=[1.0] * 20, lr=0.05, budget=40, eval_every=20, seed=5)


def sent(selection: str, strategy: str = "fedbuff", **kw) -> list[int]:
    """Jobs sent to each of 20 clients of equal speed, 5 at a time, over 40 time units (200 jobs)."""
    spec = RunSpec(**{**POPULATION, **kw}, strategy=strategy, options={"concurrency": 5, "selection": selection})
    return run(spec)["books"]["sent-per-worker"]


@pytest.mark.parametrize("strategy", ["fedbuff", "rescaled", "fedavg"])
def test_round_robin_gives_every_client_its_turn_once_per_cycle(strategy):
    rr, uniform = sent("round-robin", strategy), sent("uniform", strategy)
    assert sum(rr) == sum(uniform) >= 200
    assert max(rr) - min(rr) <= 1, rr  # 200 jobs over 20 clients: 10 each, give or take the cycle in progress
    assert max(uniform) - min(uniform) >= 4, uniform  # the uniform draw: equal on average only


@pytest.mark.parametrize("selection", list(SELECTORS))
def test_no_selection_picks_a_busy_or_an_offline_client(selection):
    spec = RunSpec(task="quadratic", strategy="rescaled", num_clients=30, lr=0.05, budget=300, eval_every=100,
                   delays="lognormal", availability="daily", availability_period=40, availability_fraction=0.5,
                   seed=2, options={"concurrency": 6, "selection": selection}).resolved()
    obs = InFlight(virtual_clock(spec).availability)  # (asserts on every job sent: idle and online)
    out = run(spec, observers=[obs])
    assert obs.most == 6 and out["books"]["balanced"] == 1
    assert out["books"].get("lost.offline", 0) > 0  # clients did go offline with jobs in flight
    assert sum(1 for n in out["books"]["sent-per-worker"] if n) >= 25


def test_the_selection_is_seeded():
    a, b = sent("round-robin"), sent("round-robin")
    c = sent("round-robin", seed=6)
    order = {s: run(RunSpec(**{**POPULATION, "seed": s, "budget": 3}, strategy="rescaled",
                            options={"concurrency": 5, "selection": "round-robin"}))["updates_per_worker"]
             for s in (5, 6)}
    assert a == b and sum(a) == sum(c)
    assert order[5] != order[6]  # another seed, another order of turns


class LowestIdle(IdleSelector):
    """A selector of one's own: the idle, online client with the lowest number."""

    name = "lowest"

    def pick(self, after):
        up = self.online_idle()
        return int(up.min()) if up.size else None


def test_a_selector_of_ones_own_plugs_in_by_name(monkeypatch):
    monkeypatch.setitem(SELECTORS, LowestIdle.name, LowestIdle)
    counts = sent("lowest")
    # Equal speeds: the 5 jobs end together and each freed slot goes to the lowest idle client,
    # the one whose job just ended: clients 0-4 do all the work.
    assert all(n > 0 for n in counts[:5]) and not any(counts[5:]), counts
    assert STRATEGIES["fedbuff"](selection="lowest").describe()["selection"] == "lowest"
    monkeypatch.delitem(SELECTORS, LowestIdle.name)
    with pytest.raises(ValueError, match="selection must be one of uniform, round-robin"):
        STRATEGIES["fedbuff"](selection="lowest")


@pytest.mark.parametrize("bad", ["", "Uniform", "round_robin", 3, None])
def test_an_unknown_selection_is_refused_with_its_name(bad):
    with pytest.raises(ValueError, match="selection must be one of"):
        STRATEGIES["rescaled"](selection=bad)


def test_the_command_line_takes_the_selection_and_says_when_it_changes_nothing():
    base = ["--task", "quadratic", "--budget", "30", "--strategy", "fedbuff"]
    bad = cli(*base, "--num-clients", "12", "--concurrency", "3", "--selection", "best")
    assert bad.returncode == 2 and "selection must be one of uniform, round-robin" in bad.stderr
    idle = cli(*base, "--selection", "round-robin")  # every client trains at once: nothing to select
    assert idle.returncode == 0 and "--selection is ignored" in idle.stderr
    ok = cli(*base, "--num-clients", "12", "--concurrency", "3", "--selection", "round-robin")
    assert ok.returncode == 0 and "ignored" not in ok.stderr, ok.stderr
    assert json.loads(ok.stdout.splitlines()[-1])["num_updates"] > 0


RR = ["--task", "quadratic", "--num-clients", "12", "--concurrency", "3", "--selection", "round-robin",
      "--quad-dim", "4", "--noise", "0.2", "--delays", "exponential", "--lr", "0.05", "--budget", "600",
      "--eval-every", "50", "--seed", "3", "--strategy", "rescaled"]


def members(ckpt) -> dict[str, bytes]:
    """A run checkpoint's zip members (read as data)."""
    with zipfile.ZipFile(io.BytesIO(ckpt.read_bytes())) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def rewrite(ckpt, files: dict[str, bytes]) -> None:
    """Write ``ckpt`` again with the members ``files`` (a well-formed zip, as the run writes it)."""
    with zipfile.ZipFile(ckpt, "w", zipfile.ZIP_STORED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)


def population_state(ckpt) -> tuple[dict, dict[str, np.ndarray]]:
    """The population's record in a run checkpoint and the arrays it names, with their members."""
    files = members(ckpt)
    names = json.loads(files["header.json"])["arrays"]
    pop = json.loads(files["state.json"])["run"]["manager"]["population"]
    arrays = {key: np.load(io.BytesIO(files[f"arrays/{names.index(ref['$array'])}.npy"]))
              for key, ref in pop["arrays"].items()}
    return pop, arrays


def test_a_round_robin_run_killed_and_resumed_ends_bit_for_bit_where_it_would_have(tmp_path):
    # The run is killed at t = 290 and resumes from its checkpoint at t = 280, where the turn is at
    # position 10 of 12: a resume that lost the turn (or the order) would ask other clients first.
    short = cli(*[a if a != "600" else "300" for a in RR], "--out", str(tmp_path / "short"), "--checkpoint-every", "70")
    assert short.returncode == 0, short.stderr
    assert population_state(tmp_path / "short" / "run.ckpt")[1]["turn"].tolist() == [10]
    ref = cli(*RR, "--out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    res = killed_then_resumed(RR, tmp_path / "killed", 70, 290, 600)
    assert res.returncode == 0, res.stderr
    np.testing.assert_array_equal(final_model(tmp_path / "killed"), final_model(tmp_path / "ref"))
    a, b = json.loads(ref.stdout.splitlines()[-1]), json.loads(res.stdout.splitlines()[-1])
    assert (a["num_updates"], a["updates_per_worker"]) == (b["num_updates"], b["updates_per_worker"])
    pop, arrays = population_state(tmp_path / "killed" / "run.ckpt")  # (the last checkpoint, as data)
    assert pop["selection"] == "round-robin" and sorted(arrays["order"].tolist()) == list(range(12))


CHECKPOINTED = ["--checkpoint-every", "100", "--budget", "250"]


def checkpointed(tmp_path):
    """A round-robin run that wrote its checkpoint; the folder."""
    out = tmp_path / "run"
    first = cli(*RR, "--out", str(out), *CHECKPOINTED)
    assert first.returncode == 0, first.stderr
    return out


def refused(out, why: str, args=RR) -> None:
    """Resuming from ``out`` is refused with one line that says ``why``, and exit status 2."""
    again = cli(*args, "--out", str(out), *CHECKPOINTED, "--resume", str(out))
    assert again.returncode == 2 and why in again.stderr, again.stderr
    assert len(again.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("key,value", [("order", np.zeros(12, np.int64)), ("order", np.arange(11, dtype=np.int64)),
                                       ("turn", np.array([12], np.int64)), ("turn", np.array([-1], np.int64))])
def test_a_checkpoint_with_a_tampered_round_robin_state_is_refused(tmp_path, key, value):
    out = checkpointed(tmp_path)
    ckpt = out / "run.ckpt"
    files = members(ckpt)
    names = json.loads(files["header.json"])["arrays"]
    ref = json.loads(files["state.json"])["run"]["manager"]["population"]["arrays"][key]["$array"]
    buf = io.BytesIO()
    np.save(buf, value)
    rewrite(ckpt, {**files, f"arrays/{names.index(ref)}.npy": buf.getvalue()})
    refused(out, "round-robin order does not fit this run")


@pytest.mark.parametrize("name", ["uniform", "lowest", "__import__('os').system('true')"])
def test_a_checkpoint_whose_selection_name_was_changed_is_refused(tmp_path, name):
    out = checkpointed(tmp_path)
    ckpt = out / "run.ckpt"
    files = members(ckpt)
    state = json.loads(files["state.json"])
    state["run"]["manager"]["population"]["selection"] = name
    rewrite(ckpt, {**files, "state.json": json.dumps(state).encode()})
    refused(out, "the checkpoint's selection is")


def test_a_checkpoint_is_resumed_only_with_its_own_selection(tmp_path):
    out = checkpointed(tmp_path)
    refused(out, "run.ckpt", args=[a if a != "round-robin" else "uniform" for a in RR])


def test_with_round_robin_rescaled_still_lands_on_the_equal_weight_point():
    """Six clients, τ from 1 to 8, b = (0, 0, 1, 1, 2, 2): the equal-weight minimiser is 1.0.

    With C = 2, round-robin gives every client the same number of deliveries (a client's turn finds it
    idle), so even Vanilla ASGD lands on 1.0. With C = 4 the slow clients are often busy when their
    turn comes and deliver less, and Vanilla settles where the deliveries put it (about 0.72, toward
    the fast clients' b = 0). Rescaled(rate) estimates each client's delivery period whatever the
    selection, and it lands on 1.0 in both cases."""
    kw = dict(taus=[1.0, 1.0, 4.0, 4.0, 8.0, 8.0], quad_a=[1.0] * 6, quad_b=[0.0, 0.0, 1.0, 1.0, 2.0, 2.0],
              lr=0.02, budget=6000, eval_every=6000, seed=1)
    two = {"concurrency": 2, "selection": "round-robin"}
    rate2, vanilla2 = (quad(strategy=s, options=two, **kw) for s in ("rescaled", "vanilla"))
    assert max(rate2["updates_per_worker"]) - min(rate2["updates_per_worker"]) <= 1
    assert rate2["final_params"][0] == pytest.approx(1.0, abs=0.05)
    assert vanilla2["final_params"][0] == pytest.approx(1.0, abs=0.05)
    four = {"concurrency": 4, "selection": "round-robin"}
    rate4, vanilla4 = (quad(strategy=s, options=four, **kw) for s in ("rescaled", "vanilla"))
    deliveries = rate4["updates_per_worker"]
    assert deliveries[0] > 2 * deliveries[5]  # a fast client delivers far more often than a slow one
    assert rate4["final_params"][0] == pytest.approx(1.0, abs=0.05)
    assert vanilla4["final_params"][0] < 0.8
