"""The whole study, stage by stage: the MNIST runs (sweeps, grid extensions, seeds; resumable), the
toy problems, then the summaries, curves, figures, claims check, ``REPORT.md`` and ``summary.json``."""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
from typing import Any

from fl_rescaled.clock import DEFAULT_TAUS

from .claims import check_claims
from .config import StudyConfig, config_from_args
from .figures import draw_figures
from .report import write_report
from .runner import Runner, quiet_logs
from .storage import atomic_write_text
from .summaries import collect
from .sweep import fmt_lr
from .timing import bare_loop_rate, log_timing, machine_info
from .toys import run_toys

MNIST_STAGE = "MNIST runs (this invocation)"


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """``python run_sim.py paper ...``: 0 when every run succeeded, 1 when some failed, 130 when
    interrupted (finished runs stay stored; the same command resumes), 2 for a bad flag."""
    cfg = config_from_args(list(argv or []))
    quiet_logs()
    import torch  # heavy: imported once the command line is known to be good

    torch.set_num_threads(cfg.threads)
    cfg.out.mkdir(parents=True, exist_ok=True)
    machine = machine_info(cfg.threads, cfg.workers)
    t_start = time.perf_counter()
    say = print if cfg.progress else (lambda *a, **k: None)
    say(f"paper study → {cfg.out}: methods {','.join(cfg.methods)}, settings {','.join(cfg.settings)}, "
        f"budget {cfg.budget:g}, {cfg.seeds} seed(s), grid {{{', '.join(fmt_lr(a) for a in cfg.grid)}}}, "
        f"{cfg.workers} process(es) × {cfg.threads} thread(s)", flush=True)

    # 1. MNIST runs (sweeps, extensions, seeds).
    runner = Runner(cfg)
    timings = _run_mnist(cfg, runner, say)
    if timings is None:
        return 130

    # 2. Toys, then 3. curves, figures, claims, report.
    t0 = time.perf_counter()
    toys = run_toys(cfg)
    res = collect(cfg, runner.sweeps)
    tau_max = max(DEFAULT_TAUS)
    figures = draw_figures(cfg.out, res, toys, tau_max)
    timings["toys, figures and report"] = time.perf_counter() - t0
    timings["total (this invocation)"] = time.perf_counter() - t_start
    claims = check_claims(cfg, res, runner.sweeps, tau_max, toys)
    report = write_report(cfg, runner, res, claims, timings, machine, figures)
    stats = {"computed": runner.computed, "reused": runner.reused, "failed": len(runner.failed),
             "seconds": timings["total (this invocation)"], "command": cfg.command,
             "chosen": {s: {m: a for m, a in c.items()} for s, c in res.chosen.items()}}
    atomic_write_text(cfg.out / "summary.json", json.dumps(stats, indent=1))
    print(f"paper study: {runner.computed} run(s) computed, {runner.reused} reused, {len(runner.failed)} failed; "
          f"{timings['total (this invocation)']:.0f} s; report {report}", flush=True)
    return 1 if runner.failed else 0


def _run_mnist(cfg: StudyConfig, runner: Runner, say) -> dict[str, float] | None:
    """Compute (or, with ``--report-only``, only load) the MNIST runs; returns the stage's timings, or
    None when interrupted. SIGTERM stops the runs like Ctrl-C (worker processes included); finished
    runs are on disk and the next invocation resumes from them."""
    t0 = time.perf_counter()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _interrupt)
    bare = None
    if not cfg.report_only:  # runs may be computed: measure the yardstick first
        bare = bare_loop_rate(2.0 if cfg.quick else 5.0)
        say(f"bare loop of the MLP step: {bare:.0f} steps/s (1 process, {cfg.threads} thread(s))", flush=True)
    started = time.strftime("%Y-%m-%d %H:%M")
    try:
        runner.run()
    except KeyboardInterrupt:
        log_timing(cfg, runner, started, time.perf_counter() - t0, bare, "interrupted")
        print(f"paper study interrupted: {runner.computed} run(s) computed and {runner.reused} reused so far are "
              f"stored under {cfg.out / 'runs'}; run the same command again to resume.", file=sys.stderr, flush=True)
        return None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    timings = {MNIST_STAGE: time.perf_counter() - t0}
    if runner.computed:
        log_timing(cfg, runner, started, timings[MNIST_STAGE], bare, "")
        rate = runner.gradients / timings[MNIST_STAGE]
        say(f"MNIST runs: {runner.computed} computed, {runner.gradients:,} replica-steps in "
            f"{timings[MNIST_STAGE]:.0f} s = {rate:.0f} replica-steps/s over {cfg.workers} "
            f"process(es); bare loop {bare or math.nan:.0f} steps/s in one process", flush=True)
    for k, v in runner.stage_seconds.items():
        if v:
            timings[f"computed {k} runs (sum of run times)"] = v
    return timings
