"""``out/REPORT.md``: the study's markdown report, rendered from the summaries, the sweeps, the
timing log and the claims check. Numbers and verdicts come from ``summaries.py`` and
``claims.py``; this module only words and formats them."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from fl_rescaled.clock import DEFAULT_TAUS, tau_stats

from .claims import (UNCHANGED, ClaimsCheck, CumulativeStepsize, ExponentialTimes, InteriorChoice, LowerLoss,
                     ToyClaim, Verdict)
from .config import LABELS, StudyConfig
from .runner import Runner
from .storage import atomic_write_text
from .summaries import Results
from .sweep import Sweep, fmt_lr
from .timing import family_label, read_timing_log


def _f(v: float, spec: str = ".4g") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def yn(b: bool) -> str:
    return "**yes**" if b else "**no**"


def write_report(cfg: StudyConfig, runner: Runner, res: Results, claims: ClaimsCheck, timings: dict[str, float],
                 machine: dict, figures: list[Path]) -> Path:
    """Write ``out/REPORT.md``; returns its path."""
    L = ["# The paper's MNIST study", ""]
    L += _header(cfg, runner)
    L += ["## Machine and time", ""]
    L += _machine_and_time(cfg, runner, timings, machine)
    L += ["## α grids and choice", ""]
    L += _grids(cfg, runner.sweeps)
    L += ["## Results at the chosen α", ""]
    L += _results(cfg, res)
    L += ["", "## Claims check (experiments.md, \"Claims\")", ""]
    L.append("Verdicts are computed from the numbers above, not written by hand.")
    L.append("")
    L += claims_lines(claims)
    if cfg.quick:
        L += ["", "Quick mode: budget, seeds and grid are far below the paper's; the verdicts above describe this "
                  "small run only."]
    L += ["", "## Files", ""]
    for f in figures:
        L.append(f"- `{f.name}`")
    L.append("- `curves/`: the curves behind the figures (median/min/max on the time grid), one CSV per setting "
             "and method; `toys/`: every toy iterate and the staleness statistics; `runs/<setting>/<method>/lr<α>_seed<s>.csv|json`: every run.")
    path = cfg.out / "REPORT.md"
    atomic_write_text(path, "\n".join(L) + "\n")
    return path


def _header(cfg: StudyConfig, runner: Runner) -> list[str]:
    st = tau_stats(DEFAULT_TAUS)
    L = [f"Command: `{cfg.command}`" + (" (quick mode: a smoke test, not the paper's budget)" if cfg.quick else ""), ""]
    L.append(f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')}. Budget {cfg.budget:g} time units per run, "
             f"evaluation every {cfg.eval_every:g} ({cfg.eval_points} points + start), {cfg.seeds} seed(s) at the "
             f"chosen α, MNIST with n = 10 one-class workers, MLP 784-128-10, batch 64, τ = "
             f"{', '.join(f'{t:g}' for t in DEFAULT_TAUS)} (τ_max = {st['tau_max']:g}, τ_H = {st['tau_H']:.4g}).")
    missing = runner.total() - runner.done
    if missing > 0:
        L.append(f"**Incomplete study: {runner.done} of the {runner.total()} runs planned so far are finished "
                 f"({missing} missing).** Rows below use the finished runs only (fewer seeds, provisional α where "
                 "a sweep is unfinished); rerun the command without `--report-only` to complete it.")
        L.append("")
    L.append("α is the cycle stepsize (sum of stepsizes per τ_max time, experiments.md). The α of each method is "
             "picked by the final training loss of seed 0; diverged runs (non-finite loss or gradients, or a final "
             "loss above the initial one) count as +inf.")
    L.append("")
    return L


def _machine_and_time(cfg: StudyConfig, runner: Runner, timings: dict[str, float], machine: dict) -> list[str]:
    L = [f"- Machine: {machine['cpu']}{family_label(machine)}, {machine['cores']} cores, {machine['platform']}, Python "
         f"{machine['python']}, torch {machine['torch']}, the MLP's products through "
         f"{machine.get('kernel', 'an unrecorded kernel')}; load average at start {machine['load']} (shared "
         "machine: timings are noisy)."]
    L.append(f"- Processes in this invocation: {cfg.workers} × {cfg.threads} torch thread(s) (the invocations that "
             "computed runs are in the timing table below).")
    L.append(f"- This invocation: {runner.computed} run(s) computed, {runner.reused} reused from `runs/`"
             + (f", {len(runner.failed)} FAILED" if runner.failed else "") + ".")
    L.append(f"- Runs of one method that share an event order are computed together, up to {cfg.batch} "
             "replicas per event loop (one gradient call per event for all of them; `--batch`). Each replica runs "
             "the single run's kernels, so it equals its single run bit for bit; the seed-0 sweep records "
             "committed on 2026-11-26 were computed with an earlier stacked product, which agrees with the "
             "single run only to float32 rounding (and bit for bit only on the AMD EPYC it was written on).")
    for k, v in timings.items():
        L.append(f"- Wall time, {k}: {v:.1f} s")
    log_rows = read_timing_log(cfg.out)
    if log_rows:
        L += _timing_table(log_rows)
    all_recs = [r for sw in runner.sweeps for r in sw.results.values()]
    sweep_secs = sum(r.get("wall_seconds", 0.0) for sw in runner.sweeps for (_, seed), r in sw.results.items()
                     if seed == 0)
    L.append(f"- Compute time of all stored runs of this study (sum of their wall times): "
             f"{sum(r.get('wall_seconds', 0.0) for r in all_recs):.0f} s over {len(all_recs)} runs; "
             f"sweep runs (seed 0) {sweep_secs:.0f} s.")
    L.append("")
    return L


def _timing_table(log_rows: list[dict[str, Any]]) -> list[str]:
    L = ["", "Every invocation that computed runs (`timing.jsonl`); replica-steps = minibatch gradients of "
             "all runs computed, bare loop = the same MLP step in a plain loop, one process, measured in "
             "that invocation:", ""]
    L.append("| started | engine | processes × threads | runs | MNIST stage wall | replica-steps/s "
             "(all processes) | bare loop steps/s (1 process) | note |")
    L.append("|---|---|---|---|---|---|---|---|")
    for r in log_rows:
        rate = r["gradients"] / r["seconds"] if r.get("seconds") else math.nan
        bare = r.get("bare_steps_per_s")
        L.append(f"| {r.get('started', '')} | {r.get('engine', '')} | {r.get('workers', '?')} × "
                 f"{r.get('threads', '?')} | {r.get('computed', 0)} | {r.get('seconds', 0) / 60:.1f} min | "
                 f"{rate:.0f} | {_f(bare, '.0f') if bare else '—'} | {r.get('note', '')} |")
    total = sum(r.get("seconds", 0.0) for r in log_rows)
    L.append("")
    L.append(f"- **Whole study, MNIST runs: {total / 60:.1f} min of wall time over {len(log_rows)} "
             f"invocation(s)**, {sum(r.get('gradients', 0) for r in log_rows):,} replica-steps.")
    return L


def _grids(cfg: StudyConfig, sweeps: list[Sweep]) -> list[str]:
    L = [f"Starting grid: {{{', '.join(fmt_lr(a) for a in cfg.grid)}}}; extension past an edge: ×10 below 1, "
         f"3, 10, 30, … above 1, at most {cfg.max_extend} step(s) per direction. Final loss of seed 0 per α "
         "(† = diverged: non-finite, or above the initial loss; counted as ∞):", ""]
    L.append("| setting | method | grid used | final loss per α (seed 0) | chosen α | choice |")
    L.append("|---|---|---|---|---|---|")
    for sw in sweeps:
        sc = {}
        for a in sw.alphas:
            r = sw.results.get((a, 0))
            if r is None:
                sc[a] = "failed" if (a, 0) in sw.failed else "not run yet"
            elif r.get("diverged"):
                sc[a] = f"{r['final_loss']:.4g}† (∞)"
            else:
                sc[a] = f"{r['final_loss']:.4g}"
        ext = []
        if sw.ext_up:
            ext.append(f"+{sw.ext_up} up")
        if sw.ext_down:
            ext.append(f"+{sw.ext_down} down")
        grid_txt = "{" + ", ".join(fmt_lr(a) for a in sw.alphas) + "}" + (f" ({', '.join(ext)})" if ext else "")
        L.append(f"| {sw.setting} | {LABELS[sw.method]} | {grid_txt} | "
                 + ", ".join(f"{fmt_lr(a)}: {v}" for a, v in sc.items())
                 + f" | {fmt_lr(sw.chosen) if sw.chosen is not None else '—'} | {sw.note} |")
    L.append("")
    return L


def _results(cfg: StudyConfig, res: Results) -> list[str]:
    L = ["Final training loss of the global objective (equal-weight average over the 10 clients): median "
         "[min, max] over seeds. Test accuracy, worst client (largest final local loss) and client spread "
         "(largest minus smallest local loss), updates, discarded jobs, wasted time and wall time are "
         "medians over seeds; idle = mean share of time a worker sat idle."]
    for s in cfg.settings:
        L += ["", f"### {s} compute times", ""]
        L.append("| method | α | final loss median [min, max] | test acc | worst client | spread | updates | "
                 "discarded | wasted time | idle | wall s/run | seeds |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for m in cfg.methods:
            x = res.summary[s].get(m)
            if not x or not x["n"]:
                continue
            div = f" ({x['diverged']} diverged)" if x["diverged"] else ""
            L.append(f"| {LABELS[m]} | {fmt_lr(res.chosen[s][m])} | {_f(x['loss_med'])} [{_f(x['loss_min'])}, "
                     f"{_f(x['loss_max'])}]{div} | {_f(x['acc'], '.2%')} | {_f(x['worst'])} | {_f(x['spread'])} | "
                     f"{_f(x['updates'], '.0f')} | {_f(x['discarded'], '.0f')} | {_f(x['wasted'], '.0f')} | "
                     f"{_f(x['idle'], '.1%')} | {_f(x['wall'], '.1f')} | {x['n']} |")
        L += ["", f"Final local loss of every client ({s}; median over seeds; client i holds digit i):", ""]
        L.append("| method | " + " | ".join(f"c{i} (τ={t:g})" for i, t in enumerate(DEFAULT_TAUS)) + " |")
        L.append("|---|" + "---|" * len(DEFAULT_TAUS))
        for m in cfg.methods:
            x = res.summary[s].get(m)
            if x and x["n"]:
                L.append(f"| {LABELS[m]} | " + " | ".join(_f(v, '.3g') for v in x["per_client"]) + " |")
    return L


# ------------------------------------------------------------------------------------------ claims
def _name(v: Verdict) -> str:
    return f"{v.number} ({v.claim}" + (f": {v.caveat})" if v.caveat else ")")


def claims_lines(c: ClaimsCheck) -> list[str]:
    """One plain summary line (which claims agree / disagree; pending ones are left out), then the details."""
    verdicts = c.verdicts()
    agree = [_name(v) for v in verdicts if v.agrees is True]
    disagree = [_name(v) for v in verdicts if v.agrees is False]
    head = (f"**In short:** the results agree with claim(s) {'; '.join(agree) if agree else 'none'}; "
            f"they disagree with claim(s) {'; '.join(disagree) if disagree else 'none'}.")
    L = [head, ""] + _lower_loss(c.lower_loss)
    if c.exponential is not None:
        L += _exponential(c.exponential)
    if c.stepsize is not None:
        L += _stepsize(c.stepsize)
    L += _interior(c.interior)
    L.append("5. *Toy problems* (final iterate after the toy's budget):")
    L += [_toy(t) for t in c.toys]
    return L


def _lower_loss(c: LowerLoss) -> list[str]:
    L = ["1. *Rescaled ASGD reaches a lower training loss than Malenia SGD and Ringleader ASGD in both "
         "settings* (median final loss over seeds, each method at its own chosen α):"]
    for row in c.settings:
        parts = [f"{LABELS[v.method]} {_f(v.loss)} → lower: {yn(v.rescaled_lower)} (ratio {_f(v.ratio, '.3g')})"
                 for v in row.rivals]
        L.append(f"   - {row.setting}: Rescaled {_f(row.rescaled)}; " + "; ".join(parts))
    if c.compared:
        L.append(f"   - Verdict: {'agrees' if c.verdict.agrees else 'disagrees'} "
                 f"({c.held}/{c.compared} comparisons hold); Rescaled's worst seed beats the other "
                 f"methods' best seed in every setting: {yn(c.separated)}.")
    return L


def _exponential(c: ExponentialTimes) -> list[str]:
    L = ["2. *Under exponential times Malenia and Ringleader slow down while Rescaled ASGD's curve is "
         "virtually unchanged* (ratio exponential / fixed of the median final loss; > 1 = worse under "
         "exponential; updates ratio < 1 = fewer model updates):"]
    for x in c.shifts:
        same = "same α" if x.alpha_fixed == x.alpha_exponential else \
            f"α {fmt_lr(x.alpha_fixed)} vs {fmt_lr(x.alpha_exponential)}"
        L.append(f"   - {LABELS[x.method]}: loss {_f(x.loss_fixed)} → {_f(x.loss_exponential)} "
                 f"(ratio {_f(x.loss_ratio, '.3g')}), updates {_f(x.updates_fixed, '.0f')} → "
                 f"{_f(x.updates_exponential, '.0f')} (ratio {_f(x.updates_ratio, '.3g')}); {same}")
    r = c.rescaled
    if r is None:
        return L
    rr = _f(r.final_ratio, '.3g')
    low, high = UNCHANGED
    L.append(f"   - Rescaled virtually unchanged (median ratio exponential / fixed of its two median loss "
             f"curves over the second half within [{low:g}, {high:g}]): {yn(r.unchanged)} (median ratio "
             f"{_f(r.curve_ratio, '.3g')}, final-loss ratio {rr}); not slowed down (median ratio ≤ {high:g}): "
             f"{yn(r.not_slower)}.")
    if r.staleness is not None:
        def _st(s: str) -> str:
            a, w = r.staleness[s]["all"], r.staleness[s]["slowest"]
            return (f"{s} mean {a['mean']:.1f}, 99th percentile {a['p99']:.0f}, max {a['max']:.0f} "
                    f"(slowest workers: 99th percentile {w['p99']:.0f}, max {w['max']:.0f})")
        L.append("   - Staleness of the applied gradients in the ASGD event order (seed 0; updates applied "
                 f"between a gradient's dispatch and its use): {_st('fixed')}; {_st('exponential')}. "
                 "Same mean, heavier tail under exponential times"
                 + (f"; Vanilla ASGD, whose step is the same for every worker, has a ratio of "
                    f"{_f(r.vanilla_ratio, '.3g')} against Rescaled's {rr}, so the slowdown is "
                    "not specific to Rescaled's weighting" if r.vanilla_ratio is not None else "")
                 + ". (A measured association, not a proof of cause.)")
    for x in r.rivals:
        L.append(f"   - {LABELS[x.method]} slows down more than Rescaled (ratio {_f(x.ratio, '.3g')} > "
                 f"{rr}): {yn(x.slower_than_rescaled)}; slows down at all (ratio > 1): {yn(x.slower)}.")
    return L


def _stepsize(c: CumulativeStepsize) -> list[str]:
    L = ["3. *Rescaled ASGD's cumulative stepsize grows at the steady rate α/τ_max* (slope of the "
         "median cumulative stepsize over the second half of the run vs α/τ_max):"]
    for x in c.slopes:
        L.append(f"   - {x.setting}: measured {_f(x.measured, '.4g')} per time unit, expected {_f(x.expected, '.4g')} "
                 f"(ratio {_f(x.ratio, '.4f')}; within the tolerance ±{x.tolerance:.1%}: {yn(x.within)}).")
    return L


def _interior(c: InteriorChoice) -> list[str]:
    return ["4. *The chosen α are interior to the (extended) grid*: "
            + "; ".join(f"{x.method}/{x.setting} α={fmt_lr(x.alpha) if x.alpha else '—'} "
                        f"{'interior' if x.note == 'interior' else (x.note or 'sweep not finished')}"
                        for x in c.choices) + "."]


def _toy(t: ToyClaim) -> str:
    a, b = t.ends
    if t.name == "toy1":
        return (f"   - τ=(1,2): Rescaled ends at {a.x:.4f} (equal-weight minimiser {a.target:.4f}; within "
                f"{a.tolerance:g}: {yn(a.near)}); Vanilla ends at {b.x:.4f} (frequency-weighted minimiser "
                f"{b.target:.4f}; within {b.tolerance:g}: {yn(b.near)}).")
    return (f"   - τ=(1,100): Delay-Adaptive ends at {a.x:.4f} (near the fast worker's +1, within {a.tolerance:g}: "
            f"{yn(a.near)}); Rescaled ends at {b.x:.4f} (near 0, within {b.tolerance:g}: {yn(b.near)}).")
