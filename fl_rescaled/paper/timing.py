"""How long the study took and on what: the machine, a yardstick (the bare loop of the paper's MLP
step) and ``out/timing.jsonl``, one row per invocation that computed runs (a study may take several)."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from fl_rescaled.settings import cpu_info
from fl_rescaled.tasks import client_rng, get_task
from fl_rescaled.tasks.mnist import kernel_name

from .config import StudyConfig
from .runner import Runner


def machine_info(threads: int, workers: int) -> dict[str, Any]:
    import torch  # heavy: only for its version

    info = cpu_info()
    cpu = info.get("model name") or platform.processor() or ""
    try:
        load = os.getloadavg()
    except OSError:
        load = (math.nan,) * 3
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": threads, "workers": workers,
            "cpu_family": " ".join(info[k] for k in ("vendor_id", "cpu family") if k in info), "kernel": kernel_name(),
            "load": " ".join(f"{v:.2f}" for v in load)}


def family_label(machine: dict[str, Any]) -> str:
    """`` (AuthenticAMD family 26)`` where a machine row recorded its CPU family (rows since issue 28's
    tenth round: the family decides the MLP's kernel, ``tasks.mnist.onednn``), else nothing."""
    family = str(machine.get("cpu_family", "")).split()
    return f" ({family[0]} family {family[1]})" if len(family) == 2 else ""


def bare_loop_rate(seconds: float) -> float:
    """Steps/s of a bare loop of the paper's MLP step on this process's torch threads: one model,
    a minibatch gradient (the hand-written one every run uses) and an in-place SGD step, no Flower,
    no strategy, no evaluation. The yardstick for the study's replica-steps per second."""
    task = get_task({"task": "mnist", "seed": 0, "num-partitions": 10, "batch-size": 64, "dirichlet-alpha": 0.0})
    x = task.initial_params(0)
    buf = np.empty_like(x)
    k, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(50):
            g, _ = task.gradient(x, k % 10, client_rng(0, k % 10, k), 64, out=buf)
            x -= np.float32(0.01) * g
            k += 1
    return k / (time.perf_counter() - t0)


def read_timing_log(out: Path) -> list[dict[str, Any]]:
    """The rows of ``out/timing.jsonl`` (unreadable lines skipped)."""
    path = out / "timing.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def log_timing(cfg: StudyConfig, runner: Runner, started: str, seconds: float, bare: float | None,
               note: str) -> None:
    """Append this invocation's MNIST-stage figures to ``timing.jsonl`` (the study may take several)."""
    if not runner.computed:
        return
    row = {"started": started, "seconds": seconds, "computed": runner.computed, "gradients": runner.gradients,
           "workers": cfg.workers, "threads": cfg.threads, "batch": cfg.batch,
           "engine": f"batched ≤{cfg.batch}" if cfg.batch > 1 else "one run per loop",
           "bare_steps_per_s": bare, "note": note}
    with (cfg.out / "timing.jsonl").open("a") as fh:
        fh.write(json.dumps(row) + "\n")
