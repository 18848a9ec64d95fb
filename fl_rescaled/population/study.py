"""The whole study: the runs (sweeps, then seeds; resumable), then the summaries, verdicts, figures,
``REPORT.md``, ``results.csv`` and ``summary.json``."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from typing import Any

from fl_rescaled.paper.runner import quiet_logs
from fl_rescaled.paper.storage import atomic_write_text
from fl_rescaled.paper.timing import bare_loop_rate, machine_info
from fl_rescaled.tasks import get_task

from .config import PopulationConfig, config_from_args
from .figures import draw_figures
from .report import write_report
from .results import collect, write_results_csv
from .runner import Runner


def main(argv: list[str] | None = None) -> int:
    """``python run_sim.py population ...``: 0 when every run succeeded, 1 when some failed, 130 when
    interrupted (finished runs stay stored; the same command resumes), 2 for a bad flag."""
    cfg = config_from_args(list(argv or []))
    quiet_logs()
    import torch  # heavy: once the command line is known to be good

    torch.set_num_threads(1)  # as in the worker processes (and the yardstick is one thread's)
    cfg.out.mkdir(parents=True, exist_ok=True)
    machine = machine_info(1, cfg.workers)
    say = print if cfg.progress else (lambda *a, **k: None)
    t_start = time.perf_counter()
    runner = Runner(cfg)
    bare = None
    if not cfg.report_only:  # runs may be computed: the yardstick first, its data loaded before it is timed
        get_task({"task": "mnist", "seed": 0, "num-partitions": 10, "batch-size": 64, "dirichlet-alpha": 0.0}).prepare()
        bare = bare_loop_rate(2.0)
    say(f"population study → {cfg.out}: {len(cfg.settings)} settings × {len(cfg.methods)} methods, budget "
        f"{cfg.budget:g}, {cfg.seeds} seed(s), {cfg.workers} process(es)"
        + (f"; bare loop {bare:.0f} steps/s" if bare else ""), flush=True)
    started = time.strftime("%Y-%m-%d %H:%M")
    previous = None
    if threading.current_thread() is threading.main_thread():  # SIGTERM stops the runs as Ctrl-C does
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        runner.run()
    except KeyboardInterrupt:
        print(f"population study interrupted: {runner.computed} run(s) computed so far are stored under "
              f"{cfg.out / 'runs'}; run the same command again to resume.", file=sys.stderr, flush=True)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    timings = {"runs (this invocation)": time.perf_counter() - t_start}
    if runner.computed:
        log_timing(cfg, runner, started, timings["runs (this invocation)"], bare)
    t0 = time.perf_counter()
    res = collect(cfg, runner)
    figures = draw_figures(cfg, res)
    write_results_csv(cfg.out / "results.csv", res, cfg)
    timings["summaries and figures"] = time.perf_counter() - t0
    report = write_report(cfg, runner, res, timings, machine, figures)
    stats = {"computed": runner.computed, "reused": runner.reused, "failed": len(runner.failed),
             "seconds": time.perf_counter() - t_start, "command": cfg.command, "chosen": res.chosen,
             "verdicts": [v.__dict__ for v in res.verdicts], "config": cfg.describe()}
    atomic_write_text(cfg.out / "summary.json", json.dumps(stats, indent=1))
    print(f"population study: {runner.computed} run(s) computed, {runner.reused} reused, {len(runner.failed)} "
          f"failed; {stats['seconds']:.0f} s; report {report}", flush=True)
    return 1 if runner.failed else 0


def log_timing(cfg: PopulationConfig, runner: Runner, started: str, seconds: float, bare: float | None) -> None:
    """Append this invocation's figures to ``out/timing.jsonl`` (a study may take several)."""
    row: dict[str, Any] = {"started": started, "seconds": seconds, "computed": runner.computed,
                           "gradients": runner.gradients, "workers": cfg.workers, "bare_steps_per_s": bare,
                           "command": cfg.command}
    with (cfg.out / "timing.jsonl").open("a") as fh:
        fh.write(json.dumps(row) + "\n")
