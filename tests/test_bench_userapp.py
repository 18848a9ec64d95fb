"""benchmarks/bench_userapp.py at a tiny size: its table has every row, and every row did the same
client trainings (no timing is checked). Flower's engine is left out (``--no-flower``): Ray's
start-up alone takes longer than the rest."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_userapp.py"
TINY = ["--trainings", "10", "--nodes", "5", "--repeats", "1", "--examples-per-client", "40", "--no-flower"]


@pytest.fixture
def bench(monkeypatch):
    """The benchmark module, imported from its file; what it changes in this process (sys.path,
    torch's threads, Flower's log level, the example's ``report``) is restored afterwards."""
    threads = torch.get_num_threads()
    levels = {name: logging.getLogger(name).level for name in ("flwr", "fl_rescaled")}
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("bench_userapp", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_userapp", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.example_server, "report", module.example_server.report)
    yield module
    torch.set_num_threads(threads)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.mnist
def test_every_row_does_the_same_trainings(bench, mnist_cache):
    out = bench.measure(bench.parse_args(TINY))
    table = {row["row"]: row for row in out["table"]}
    assert list(table) == [bench.IN1, bench.IN2, bench.BARE1, bench.BARE2]
    for row in table.values():
        assert row["trainings"] == 10, row  # one count per row: every run of it did 10
        assert row["runs"] == 1 and row["torch_threads_per_job"] == 1
        assert row["evaluations"] == 0  # fraction-evaluate 0: training only, as the bare loop
        assert row["best_s"] > 0 and row["trainings_per_s"] == pytest.approx(10 / row["best_s"])
        assert row["cores"] == (2 if row["row"] in (bench.IN2, bench.BARE2) else 1)
    assert table[bench.BARE1]["x_bare"] == 1.0
    assert out["trainings"] == 10 and out["nodes"] == 5 and out["extra"] == {}


@pytest.mark.mnist
def test_evaluations_and_the_codec_row(bench, mnist_cache):
    out = bench.measure(bench.parse_args([*TINY, "--fraction-evaluate", "0.4", "--cached-codec"]))
    table = {row["row"]: row for row in out["table"]}
    assert list(table) == [bench.IN1, bench.IN2, bench.BARE1, bench.BARE2, bench.IN1_CODEC]
    assert all(row["trainings"] == 10 for row in table.values())
    # FedAvg's cost for 10 trainings: a point per round's worth (2: fraction-train 0.25 of 5 nodes, at
    # least 2), none at the start, each on 2 of the 5 nodes: 5 × 2; the bare loop has none.
    assert table[bench.IN1]["evaluations"] == table[bench.IN2]["evaluations"] == 10
    assert table[bench.IN1_CODEC]["evaluations"] == 10
    assert table[bench.BARE1]["evaluations"] == 0


def test_cached_codec_writes_flowers_bytes_and_is_undone(bench):
    from flwr.app import Array

    numpy, from_ndarray = Array.numpy, Array.from_numpy_ndarray
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1, 2], dtype=np.int64),
              np.array(2.5), np.ones((2, 3), order="F")]
    flower = [Array(a) for a in arrays]
    cached = bench.with_cached_codec(lambda: [(Array(a), Array(a).numpy()) for a in arrays])
    for a, ref, (arr, back) in zip(arrays, flower, cached):
        assert arr.data == ref.data and arr.shape == ref.shape and arr.dtype == ref.dtype
        np.testing.assert_array_equal(back, a)
        assert back.flags.writeable and back.dtype == a.dtype
    assert Array.numpy is numpy and Array.from_numpy_ndarray == from_ndarray


def test_trainings_must_fill_the_buffer_and_the_rounds(bench):
    for trainings, nodes in (("15", "5"), ("0", "5"), ("20", "3")):
        with pytest.raises(SystemExit, match="multiple of 10"):
            bench.measure(bench.parse_args(["--trainings", trainings, "--nodes", nodes, "--no-flower"]))


@pytest.mark.mnist
def test_command_line_prints_the_table(mnist_cache):
    proc = subprocess.run([sys.executable, str(BENCH), *TINY, "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [row["trainings"] for row in out["table"]] == [10, 10, 10, 10]
    assert out["nproc"] >= 1 and len(out["loadavg"]) == 3


@pytest.mark.mnist
def test_the_batched_helper_row_does_the_same_trainings(bench, mnist_cache):
    out = bench.measure(bench.parse_args([*TINY, "--helper"]))
    table = {row["row"]: row for row in out["table"]}
    assert list(table)[-1] == bench.HELPER
    assert table[bench.HELPER]["trainings"] == 10 and table[bench.HELPER]["evaluations"] == 0
