"""A heterogeneous client population: compute-time models, changing speeds, availability, trace files."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from fl_rescaled import traces
from fl_rescaled.availability import Always, Availability, Daily, TraceAvailability, availability
from fl_rescaled.clock import DEFAULT_TAUS, DelayModel
from fl_rescaled.delays import (ComputeTimes, Fixed, LogNormal, Pareto, TraceTimes, compute_times,
                                tau_profile)
from fl_rescaled.speeds import Drift, Switch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "traces"


def refused(fn, *args, match: str, **kw) -> str:
    """Call fn, expect a one-line ValueError matching ``match``; return the message."""
    with pytest.raises(ValueError, match=match) as info:
        fn(*args, **kw)
    assert "\n" not in str(info.value)
    return str(info.value)


# ------------------------------------------------------------------------------------ compute times


@pytest.mark.parametrize("kind", ["fixed", "exponential"])
@pytest.mark.parametrize("seed", [0, 7])
def test_fixed_and_exponential_draw_what_the_paper_runs_drew(kind, seed):
    """Bit for bit the draws of the delay model the paper's runs used (stored records depend on it):
    τ_i exactly, or ``default_rng((seed, 0xDE1A, i)).exponential(τ_i)`` in each client's own order."""
    taus = [1.0, 2.0, 4.0, 8.0, 16.0, 3.5]
    new = compute_times(kind, taus, seed=seed)
    order = np.random.default_rng(1).integers(0, len(taus), 3000)  # an arbitrary interleaving of workers
    rngs = {i: np.random.default_rng((seed, 0xDE1A, i)) for i in range(len(taus))}
    expected = [taus[w] if kind == "fixed" else float(rngs[int(w)].exponential(taus[w])) for w in order]
    assert [new.sample(int(w), 0.1 * k) for k, w in enumerate(order)] == expected
    assert [new.mean(i) for i in range(len(taus))] == taus
    assert DelayModel(taus, kind, seed).describe() == new.describe()


def test_a_clients_draws_do_not_depend_on_the_others():
    a, b = LogNormal([1.0, 5.0], sigma=0.8, seed=2), LogNormal([1.0, 5.0], sigma=0.8, seed=2)
    alone = [a.sample(1, 0.0) for _ in range(20)]
    mixed = []
    for _ in range(20):
        b.sample(0, 0.0)
        mixed.append(b.sample(1, 0.0))
    assert alone == mixed
    assert alone != [LogNormal([1.0, 5.0], sigma=0.8, seed=3).sample(1, 0.0) for _ in range(20)]


# The sample mean of n independent draws has standard deviation τ·cv/√n, cv the coefficient of
# variation: sqrt(exp(σ²) − 1) = 0.533 for the lognormal with σ = 0.5, 1/sqrt(α(α − 2)) = 0.258 for
# the Pareto with α = 5 (finite fourth moment, so the mean is close to normal). We allow 5 standard
# deviations (a fixed seed makes the test deterministic; a fresh seed fails with probability < 1e-6).
@pytest.mark.parametrize("model,cv", [(LogNormal, math.sqrt(math.exp(0.25) - 1)), (Pareto, 1 / math.sqrt(15))])
def test_lognormal_and_pareto_sample_means_approach_tau(model, cv):
    taus, n = np.array([0.5, 3.0, 40.0]), 40_000
    m = model(taus, sigma=0.5, seed=11) if model is LogNormal else model(taus, alpha=5.0, seed=11)
    assert np.array_equal(m.means(), taus)
    for i, tau in enumerate(taus):
        draws = np.array([m.sample(i, 0.0) for _ in range(n)])
        assert abs(draws.mean() - tau) < 5 * tau * cv / math.sqrt(n)
        assert draws.min() > 0
        if model is Pareto:  # every draw is at least x = τ(α − 1)/α; P(X > 2x) = 2^-α (sd of a frequency ≤ 0.5/√n)
            x = tau * 4 / 5
            assert draws.min() >= x and abs(np.mean(draws > 2 * x) - 2**-5) < 5 * 0.5 / math.sqrt(n)
        else:  # μ = ln τ − σ²/2: the median exp(μ) is τ·exp(−σ²/2) = τ·e^−0.125
            assert abs(np.mean(draws < tau * math.exp(-0.125)) - 0.5) < 5 * 0.5 / math.sqrt(n)


def test_trace_durations_are_used_in_order_and_cycle():
    m = TraceTimes.from_lists([[1.0, 2.0, 3.0], [5.0]])
    assert [m.sample(0, 0.0) for _ in range(7)] == [1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0]
    assert [m.sample(1, 9.0) for _ in range(3)] == [5.0, 5.0, 5.0]
    assert m.mean(0) == 2.0 and list(m.means()) == [2.0, 5.0]
    refused(TraceTimes.from_lists, [[1.0], []], match="each client")
    refused(TraceTimes.from_lists, [[1.0, -2.0]], match="durations")


def test_drift_and_switch_scale_durations_by_the_start_time():
    base = Fixed([2.0, 4.0])
    linear = Drift(base, rate=0.1)
    assert linear.sample(0, 10.0) == pytest.approx(4.0) and linear.sample(1, 0.0) == 4.0
    assert linear.mean(0) == 2.0 and list(linear.means()) == [2.0, 4.0]
    geometric = Drift(base, rate=1.0, mode="geometric", max_factor=100.0)
    assert geometric.factor(0, 3.0) == pytest.approx(8.0) and geometric.factor(1, 50.0) == pytest.approx(100.0)
    faster = Drift(base, rate=-0.1, min_factor=0.25)
    assert faster.factor(0, 5.0) == pytest.approx(0.5) and faster.factor(0, 20.0) == 0.25
    switch = Switch(base, at=5.0, factor=3.0, clients=[1])
    assert [switch.sample(1, t) for t in (0.0, 4.999, 5.0, 100.0)] == [4.0, 4.0, 12.0, 12.0]
    assert switch.sample(0, 100.0) == 2.0
    nested = Switch(Drift(base, rate=0.1), at=5.0, factor=0.5)
    assert nested.sample(0, 10.0) == pytest.approx(2.0 * 2.0 * 0.5)
    many = Switch(Fixed(np.ones(1000)), at=1.0, factor=2.0, fraction=0.3, seed=4)
    affected = [i for i in range(1000) if many.factor(i, 2.0) == 2.0]
    assert len(affected) == 300
    assert affected == [i for i in range(1000) if Switch(Fixed(np.ones(1000)), at=1.0, factor=2.0, fraction=0.3,
                                                         seed=4).factor(i, 2.0) == 2.0]
    refused(Drift, base, rate=-2.0, mode="geometric", match="rate")
    refused(Switch, base, at=1.0, factor=0.0, match="factor")
    refused(switch.sample, 0, math.nan, match="finite")


def test_generators_are_created_on_a_clients_first_draw():
    m = compute_times("lognormal", tau_profile(100_000), seed=0, drift={"rate": 0.01})
    assert m.state()["base"]["rngs"] == {}
    m.sample(99_999, 3.0)
    assert list(m.state()["base"]["rngs"]) == ["99999"]
    refused(m.sample, 100_000, 0.0, match="not in 0..99999")


def _models():
    taus = tau_profile(50, "lognormal", seed=3)
    return [compute_times("exponential", taus, seed=5), compute_times("lognormal", taus, seed=5, sigma=1.0),
            compute_times("pareto", taus, seed=5, alpha=2.5),
            TraceTimes.from_lists([[float(i + 1), 0.5, 2.0][: 1 + i % 3] for i in range(50)]),
            compute_times("pareto", taus, seed=5, drift={"rate": 0.01, "mode": "geometric"},
                          switch={"at": 20.0, "factor": 2.0, "fraction": 0.5})]


@pytest.mark.parametrize("index", range(5))
def test_restored_state_gives_the_draws_an_uninterrupted_model_gives(index):
    ref, resumed = _models()[index], _models()[index]
    rng = np.random.default_rng(index)
    for k in range(200):
        ref.sample(int(rng.integers(0, 10)), float(k))
    saved = json.loads(json.dumps(ref.state()))
    resumed.restore(saved)
    assert resumed.state() == saved  # restored generators not drawn from yet are kept
    clients = rng.integers(0, 50, 300)
    assert [resumed.sample(int(c), 200.0 + k) for k, c in enumerate(clients)] == \
           [ref.sample(int(c), 200.0 + k) for k, c in enumerate(clients)]
    assert isinstance(ref, ComputeTimes)
    json.dumps(ref.describe())


def test_restore_refuses_malformed_states_and_keeps_its_own():
    m = compute_times("exponential", [1.0, 2.0, 3.0], seed=1)
    m.sample(0, 0.0)
    good = m.state()
    twin = compute_times("exponential", [1.0, 2.0, 3.0], seed=1)
    twin.restore(good)
    bad_inc = json.loads(json.dumps(good))
    bad_inc["rngs"]["0"]["state"]["inc"] += 1
    cases = {"kind": {**good, "kind": "lognormal"}, "seed": {**good, "seed": 2},
             "key": {**good, "rngs": {"7": good["rngs"]["0"]}}, "PCG64": bad_inc, "keys": {"kind": "exponential"},
             "client id": {**good, "rngs": {"-1": good["rngs"]["0"]}}}
    for match, state in cases.items():
        refused(twin.restore, state, match=match)
    assert twin.sample(0, 0.0) == m.sample(0, 0.0)
    trace = TraceTimes.from_lists([[1.0, 2.0]])
    refused(trace.restore, {**trace.state(), "positions": {"0": -1}}, match="positions")
    refused(compute_times("pareto", [1.0], alpha=2.0, switch={"at": 1.0, "factor": 2.0}).restore,
            {"kind": "drift", "base": {}}, match="switch")


def test_tau_profiles():
    assert tuple(tau_profile(25)) == (DEFAULT_TAUS * 3)[:25]
    pop = tau_profile(100_000, "lognormal", scale=4.0, spread=0.5, seed=1)
    # population mean 4 with coefficient of variation sqrt(e^0.25 − 1) = 0.53: 5 sd of the mean is 0.034
    assert abs(pop.mean() - 4.0) < 0.034 and np.array_equal(pop, tau_profile(100_000, "lognormal", scale=4.0,
                                                                              spread=0.5, seed=1))
    uni = tau_profile(1000, "uniform", low=2.0, high=3.0)
    assert uni.min() >= 2.0 and uni.max() < 3.0
    refused(tau_profile, 10, "zipf", match="unknown")


def test_factory_refuses_bad_settings():
    refused(compute_times, "gamma", [1.0], match="unknown")
    refused(compute_times, "trace", [1.0], match="trace")
    refused(compute_times, "lognormal", [1.0, -1.0], match=r"taus\[1\]")
    refused(compute_times, "pareto", [1.0], alpha=1.0, match="alpha")
    refused(compute_times, "exponential", [1.0], seed=-1, match="seed")
    refused(compute_times, "fixed", [1.0], drift={"rate": 0.1, "speed": 2}, match="drift options")
    refused(compute_times, "fixed", [1.0], switch={"at": 1.0, "factor": 2.0, "clients": [3]}, match="client ids")


# ------------------------------------------------------------------------------------- availability


def test_trace_intervals_are_online_at_start_and_offline_at_end():
    a = TraceAvailability.from_lists([[(0.0, 1.0), (2.0, 3.0)], []])
    assert [a.online(0, t) for t in (-1.0, 0.0, math.nextafter(1.0, 0), 1.0, 1.5, 2.0, 3.0)] == \
           [False, True, True, False, False, True, False]
    assert (a.next_on(0, 1.0), a.next_on(0, 0.5), a.next_on(0, 3.0)) == (2.0, 0.5, math.inf)
    assert (a.next_off(0, 0.0), a.next_off(0, 1.0), a.next_off(0, 2.5)) == (1.0, 1.0, 3.0)
    assert not a.online(1, 0.5) and a.next_on(1, 0.0) == math.inf and a.next_off(1, 0.0) == 0.0
    refused(TraceAvailability.from_lists, [[(0.0, 1.0), (1.0, 2.0)]], match="touch")
    refused(a.online, 2, 0.0, match="not in 0..1")
    refused(a.next_on, 0, math.inf, match="finite")
    refused(Daily(2).online_mask, [0, 1], math.nan, match="finite")


def test_always_is_always_online():
    a = availability("always", 3)
    assert a.online(2, 1e9) and a.next_on(0, 5.0) == 5.0 and a.next_off(1, 5.0) == math.inf
    assert a.online_mask(np.arange(3), 0.0).all() and list(a.next_on_many(np.arange(3), 2.0)) == [2.0] * 3


def test_daily_cycle_online_fraction():
    n, d, period = 2000, 0.3, 24.0
    a = Daily(n, period=period, fraction=d, seed=3)
    grid = np.arange(0.0, 50 * period, period / 1000)  # 50 periods, 1000 points each
    for client in range(5):  # over whole periods, a grid point in 1000 is the most a boundary can shift
        share = np.mean([a.online(client, float(t)) for t in grid])
        assert abs(share - d) <= 2 / 1000
    # At a given time the random phases make the online count Binomial(n, d): allow 5 sd of its share.
    for t in (0.0, 7.5, 1000.0):
        assert abs(a.online_mask(np.arange(n), t).mean() - d) < 5 * math.sqrt(d * (1 - d) / n)
    assert Daily(n, period=period, fraction=d, seed=3).next_on(5, 1.0) == a.next_on(5, 1.0)
    refused(Daily, 3, fraction=1.5, match="fraction")
    refused(Daily, 3, period=[1.0, 2.0], match="shape")


def _availability_models():
    per_client = Daily(6, period=[24.0, 10.0, 1.0, 7.0, 24.0, 3.0], fraction=[0.5, 0.9, 0.25, 0.0, 1.0, 0.999],
                       seed=9)
    trace = TraceAvailability.from_lists([[(0.0, 1.0), (2.0, 3.5)], [], [(-5.0, 0.25), (0.5, 40.0)],
                                          [(10.0, 11.0)], [(0.75, 1.0), (7.25, 9.0), (30.0, 30.25)]])
    return [per_client, trace, Always(3), Daily(50, period=5.0, fraction=0.4, seed=1)]


@pytest.mark.parametrize("index", range(4))
def test_next_on_and_next_off_agree_with_online_on_a_grid(index):
    a = _availability_models()[index]
    grid = np.arange(-2.0, 60.0, 0.125)
    for client in range(a.num_clients):
        on = np.array([a.online(client, float(t)) for t in grid])
        for k, t in enumerate(grid):
            t = float(t)
            start, stop = a.next_on(client, t), a.next_off(client, t)
            assert start >= t and stop >= t and (start == t) == on[k] and (stop == t) == (not on[k])
            if math.isfinite(start):
                assert a.online(client, start)
            if math.isfinite(stop):
                assert not a.online(client, stop)
            assert not on[k:][grid[k:] < start].any() and on[k:][grid[k:] < stop].all()
        edges = [a.next_on(client, 5.3), a.next_off(client, 5.3)]  # the vectorised calls at a boundary too
        for t in [0.0, 13.37, 59.0] + [e for e in edges if math.isfinite(e)]:
            ids = np.arange(a.num_clients)
            assert list(a.online_mask(ids, t)) == [a.online(i, t) for i in ids]
            assert list(a.next_on_many(ids, t)) == [a.next_on(i, t) for i in ids]
    assert isinstance(a, Availability) and a.state() == json.loads(json.dumps(a.state()))
    a.restore(a.state())
    refused(a.restore, {"kind": "other"}, match="not a state")
    json.dumps(a.describe())


# ------------------------------------------------------------------------------------------- files


def test_the_committed_examples_load_and_agree_across_formats(tmp_path):
    d_csv, d_json = (traces.read_durations(EXAMPLES / f"durations.{s}") for s in ("csv", "json"))
    a_csv, a_json = (traces.read_availability(EXAMPLES / f"availability.{s}") for s in ("csv", "json"))
    assert all(np.array_equal(x, y) for x, y in zip(d_csv, d_json))
    assert all(np.array_equal(x, y) for x, y in zip(a_csv, a_json))
    assert len(d_csv[1]) == len(a_csv[2]) == 21
    # The generator writes what is committed (within the files' rounding).
    traces.write_example_traces(tmp_path, num_clients=20, seed=0)
    again = traces.read_durations(tmp_path / "durations.csv"), traces.read_availability(tmp_path / "availability.csv")
    assert np.array_equal(again[0][1], d_csv[1]) and np.allclose(again[0][0], d_csv[0], atol=1.1e-3)
    assert np.array_equal(again[1][2], a_csv[2]) and np.allclose(again[1][0], a_csv[0], atol=0.11)
    model = compute_times("trace", trace=EXAMPLES / "durations.json")
    assert model.sample(0, 0.0) == d_csv[0][0] and model.num_clients == 20
    assert availability("trace", trace=EXAMPLES / "availability.csv", num_clients=25).next_on(24, 0.0) == math.inf


def test_written_traces_read_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    values, offsets = rng.exponential(3.0, 40), np.array([0, 5, 6, 30, 40])
    ends = np.cumsum(rng.uniform(0.1, 2.0, 40))
    for suffix in ("csv", "json"):
        traces.write_durations(tmp_path / f"d.{suffix}", values, offsets)
        got = traces.read_durations(tmp_path / f"d.{suffix}")
        assert np.array_equal(got[0], values) and np.array_equal(got[1], offsets)
        traces.write_availability(tmp_path / f"a.{suffix}", ends[0::2], ends[1::2], offsets // 2)
        got = traces.read_availability(tmp_path / f"a.{suffix}")
        assert np.array_equal(got[0], ends[0::2]) and np.array_equal(got[1], ends[1::2])


def test_availability_rows_in_any_order_are_sorted_and_touching_ones_merged(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("client,start,end\n1,5,6\n0,2,3\n0,0,1\n0,1,2\n")
    a = TraceAvailability.from_file(path, num_clients=3)
    assert a.next_off(0, 0.5) == 3.0 and a.online(0, 1.0) and a.next_on(1, 0.0) == 5.0 and not a.online(2, 5.0)
    path.write_text("client,start,end\n0,0,2\n1,0,9\n0,1.5,3\n")
    assert "line 4 overlaps" in refused(traces.read_availability, path, match="line 2")


BAD_FILES = [
    ("d.csv", "client,time\n0,1\n", "line 1 must be the header"),
    ("d.csv", "client,duration\n0,1\n0,-2\n", "line 3: a duration must be positive"),
    ("d.csv", "client,duration\n0,1\n0,0\n", "line 3: a duration"),
    ("d.csv", "client,duration\n0,nan\n", "line 2: a duration"),
    ("d.csv", "client,duration\n0,1\n1,inf\n", "line 3: a duration"),
    ("d.csv", "client,duration\n0,1\n2,1\n", "client 1 has no durations"),
    ("d.csv", "client,duration\n0,1\n0.5,1\n", "line 3: a client id"),
    ("d.csv", "client,duration\n0,1\n-1,1\n", "line 3: a client id"),
    ("d.csv", "client,duration\n0,1\n0,abc\n", "line 3: expected 2"),
    ("d.csv", "client,duration\n0,1\n0,1,2\n", "line 3: expected 2"),
    ("d.csv", "client,duration\n0,1\n\n0,2\n", "line 3 is blank"),
    ("d.csv", "client,duration\n", "no rows"),
    ("a.csv", "client,start,end\n0,1,1\n", "line 2: an interval needs start < end"),
    ("a.csv", "client,start,end\n0,2,1\n", "line 2: an interval"),
    ("a.csv", "client,start,end\n0,0,1\n5,0,1\n", "line 3: client id out of range 0..2"),
    ("a.csv", "client,start,end\n0,nan,1\n", "line 2: times must be finite"),
    ("a.csv", "client,start,end\n99999999999,0,1\n", "line 2: client ids must stay below"),
    ("a.txt", "client,start,end\n0,0,1\n", "ends in .csv or .json"),
    ("d.json", '{"clients": {"0": [1, -1]}}', "client 0, entry 2: a duration"),
    ("d.json", '{"clients": {"0": [1, NaN]}}', "NaN is not a number JSON allows"),
    ("d.json", '{"clients": {"0": [1], "0": [2]}}', "twice"),
    ("d.json", '{"clients": {"00": [1]}}', "not a client id"),
    ("d.json", '{"clients": {"0": ["1"]}}', "client 0: expected a list of numbers"),
    ("d.json", '{"clients": {"0": [1]}, "num_clients": 2}', "client 1 has no durations"),
    ("d.json", '{"clients": [[1]]}', "expected an object"),
    ("d.json", '{"clients": {"0": [1]}, "extra": 1}', "expected an object"),
    ("d.json", '{"clients": {"0": [1]', "not JSON"),
    ("d.json", '{"clients": {"0": ' + "[" * 100_000 + "]" * 100_000 + "}}", "nested too deeply"),
    ("a.json", '{"clients": {"0": [[0, 1], [1]]}}', "client 0: expected a list of"),
    ("a.json", '{"clients": {"0": [[0, 1, 2]]}}', "client 0: expected a list of"),
    ("a.json", '{"clients": {"1": [[0, 1]], "0": [[3, 2]]}}', "client 0, entry 1: an interval"),
    ("a.json", '{"clients": {"0": [[0, 2], [1, 3]]}}', "client 0, entry 2 overlaps"),
    ("a.json", '{"clients": {"4": [[0, 1]]}, "num_clients": 2}', "client 4, entry 1: client id out of range"),
]


@pytest.mark.parametrize("name,text,match", BAD_FILES, ids=[m for _, _, m in BAD_FILES])
def test_malformed_trace_files_are_refused_with_one_line(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    reader = traces.read_durations if name.startswith("d") else traces.read_availability
    num_clients = 3 if "out of range 0..2" in match else None
    assert str(path) in refused(reader, path, num_clients=num_clients, match=match)


def test_oversized_trace_files_are_refused_before_reading(tmp_path):
    big = tmp_path / "big.csv"
    with open(big, "wb") as f:  # a sparse file just over the default limit: nothing is read
        f.write(b"client,duration\n")
        f.truncate(traces.MAX_CSV_BYTES + 1)
    refused(traces.read_durations, big, match="over the limit")
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"clients": {str(i): [1.0] * 10 for i in range(100)}}))
    refused(traces.read_durations, small, max_bytes=1000, match="over the limit of 1000")
    assert traces.read_durations(small, max_bytes=os.path.getsize(small))[1][-1] == 1000
