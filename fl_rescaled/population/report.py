"""``out/REPORT.md``: the population study's report, worded from the stored runs, the summaries and
the verdicts (``results``); no number or verdict in it is written by hand."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from fl_rescaled.paper.storage import atomic_write_text
from fl_rescaled.paper.timing import family_label, read_timing_log

from .config import BY_NAME, MODEL, RATE, PopulationConfig, fedavg_concurrency
from .results import Results, Verdict
from .runner import Runner

TITLE = "# A population study: Rescaled(rate) against FedAvg, FedBuff, FedAsync, Vanilla ASGD and Rescaled(τ)"
NOT_WIN = "## Where Rescaled(rate) does not win"


def _f(v: Any, spec: str = ".4g") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def write_report(cfg: PopulationConfig, runner: Runner, res: Results, timings: dict[str, float],
                 machine: dict[str, Any], figures: list[Path]) -> Path:
    L = [TITLE, "", f"Command: `{cfg.command}`" + (" (quick mode: a smoke test, not the study)" if cfg.quick else ""),
         "", f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')} from the runs stored under `runs/`."]
    missing = runner.planned() - sum(len(c.sweep.results) + len(c.sweep.failed) for c in runner.cells)
    if missing > 0 or runner.failed:
        L.append(f"**Incomplete: {missing} planned run(s) missing, {len(runner.failed)} failed.** The numbers below "
                 "use the finished runs only.")
    L += ["", "## The population", ""] + population_lines(cfg, runner)
    L += ["", "## The methods", ""] + method_lines(cfg)
    L += ["", "## Machine and time", ""] + time_lines(cfg, runner, timings, machine)
    L += ["", "## Grids and choices", ""] + grid_lines(cfg, runner) + unstable_lines(res)
    L += ["", "## Results", ""] + result_lines(cfg, res, figures)
    L += [""] + verdict_lines(res.verdicts, res.same_runs)
    L += ["", "## Files", "", "- `fig_<setting>.png`: accuracy and loss against virtual time, one per setting;",
          "- `results.csv`: the tables above; `curves/<setting>_<method>.csv`: the curves behind the figures;",
          "- `runs/<setting>/<method>/lr<value>_seed<s>.json`: every run's record (the value is the tuned knob, "
          "α or η_l; the record's `curve` holds its evaluations).", ""]
    path = cfg.out / "REPORT.md"
    atomic_write_text(path, "\n".join(L))
    return path


def population_lines(cfg: PopulationConfig, runner: Runner) -> list[str]:
    m, T = MODEL, cfg.budget
    sig, spread, P, d = m["delay_sigma"], m["tau_spread"], m["availability_period"], m["availability_fraction"]
    parts = {}
    for c in runner.cells:
        for r in c.sweep.results.values():
            parts.setdefault(c.setting.dirichlet, []).append((r.get("study") or {}).get("partition") or {})
    L = [f"- **Clients**: N = {m['num_clients']} MNIST clients, {m['partition_size']} training examples each (the "
         "objective, the equal-weight average of the client losses, is then also the size-weighted one); the MLP "
         "784-128-10, minibatches of 64.",
         f"- **Compute times**: client i's mean τ_i from a lognormal profile of mean 1 and spread {spread:g} (log τ_i "
         f"~ N(−{spread:g}²/2, {spread:g}²): the 5th and 95th percentile clients are {math.exp(2 * 1.645 * spread):.0f}× "
         "apart, about the paper's 16× between its fastest and slowest workers, a phone-to-phone range), and each "
         f"job a lognormal draw around τ_i with σ = {sig:g} (coefficient of variation "
         f"{math.sqrt(math.exp(sig ** 2) - 1):.2f}: the same device varies from job to job with its load).",
         f"- **Availability**: a daily cycle of period P = {P:g} with a random phase per client, online a fraction "
         f"d = {d:g} of it: about {d * m['num_clients']:.0f} clients online at any time. The budget T = {T:g} spans "
         f"{T / P:g} periods" + (", so every client comes online several times and the time of day averages out"
                                 if T >= 2 * P else " (quick mode: a fraction of one)") + "; a "
         f"client's online window d·P = {d * P:g} is {d * P:g}× the mean compute time, so most jobs finish in it "
         "but the slowest clients (τ_i of 5 or more) lose a sizeable share of theirs when they go offline.",
         "- **Settings**: label skew α ∈ {0.1, 0} × concurrency C ∈ {10, 100} (C = 100 = N: every online client "
         "trains; C = 10: a freed slot goes to a client drawn uniformly from the idle online ones)."]
    for a in sorted(parts, reverse=True):
        info = [p for p in parts[a] if p]
        if not info:
            continue
        if a == 0:
            L.append(f"- **α = 0**: one digit per client, 10 clients per digit, {info[0]['size']} examples each: the "
                     "core's partition (`fl_rescaled.data.partition_labels`; `split` and `mix` agree at α = 0).")
        else:
            mean_cls = sum(p["classes_per_client_mean"] for p in info) / len(info)
            shared = max(p["shared_examples"] for p in info)
            L.append(f"- **α = {a:g}**: {info[0]['kind']} (Hsu et al.'s label skew: client i's digit mix q_i ~ "
                     f"Dirichlet({a:g}·1), then {m['partition_size']} examples from it): {mean_cls:.1f} digits per "
                     f"client on average; at most {shared:,} of the {m['num_clients'] * m['partition_size']:,} "
                     "example slots hold an example another client holds too (digits asked for more often than "
                     "they occur). This is the core's `--partition mix`; its default, `split`, trims every "
                     f"client to the smallest, which leaves {_span([p['core_trimmed_size'] for p in info])} "
                     "examples per client here (`fl_rescaled/data/partition.py`).")
    return L


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo} to {hi}"


def method_lines(cfg: PopulationConfig) -> list[str]:
    L = ["Every job is the same work, one SGD step on one minibatch of 64 (H = 1 local step), and takes the "
         "client's compute time whatever the method, so the methods get the same compute in the same virtual "
         "time (communication is free on this clock, so local steps would only buy more compute per job). FedAvg, "
         "FedBuff and FedAsync take model replies (their ClientApp trains and returns the model), the ASGD methods "
         "gradient replies; with H = 1 the two carry the same information (the update is η_l times the gradient).",
         "", "| method | strategy and options | tuned | starting grid |", "|---|---|---|---|"]
    tuned = {"lr": "α, the cycle stepsize (`lr`)", "local_lr": "η_l, the clients' learning rate (`local_lr`)"}
    for m in cfg.methods:
        opts = ", ".join(f"{k}={v}" for k, v in m.options.items())
        extra = {"fedavg": "; α = 1 is FedAvg; C = 100 settings: C = "
                           f"{fedavg_concurrency(cfg.settings[-1])} per round (below)",
                 "fedbuff": "; buffer K = 10, server rate 1, staleness exponent 0.5 (defaults)",
                 "fedasync": "; mixing 0.6, polynomial staleness a = 0.5 (defaults)"}.get(m.name, "")
        L.append(f"| {m.label} | `{m.strategy}`{f' ({opts})' if opts else ''}{extra} | {tuned[m.knob]} | "
                 f"{{{', '.join(f'{v:g}' for v in cfg.grid(m))}}} |")
    L += ["", "The tuned value of each method is chosen per setting by the final training loss of seed 0 on the "
              "grid (extended by one step of the 1, 3, 10, … ladder past an edge that wins, at most "
              f"{cfg.max_extend} per direction); the other seeds run at that value. Starting grids were centred "
              "on one pilot run per method at a smaller budget.",
          "", f"At C = N FedAvg samples C = {fedavg_concurrency(cfg.settings[-1])} (= d·N, the mean number "
              "online) per round, as many clients as the asynchronous methods have in flight there. (The study "
              "was designed when the engine's FedAvg round at C = N let a client that came online join the round "
              "in progress, so that under the daily cycle a round hardly ever closed; a round is now the clients "
              "online at its start.) At C = N Rescaled(rate) reads each client's delivery period estimated from "
              "its deliveries, as at C = 10: a client busy whenever it is online delivers less often than 1/τ_i, "
              "by its share of time online and the jobs it loses going offline."]
    return L


def time_lines(cfg: PopulationConfig, runner: Runner, timings: dict[str, float], machine: dict[str, Any]) -> list[str]:
    L = [f"- Machine: {machine['cpu']}{family_label(machine)}, {machine['cores']} cores, Python {machine['python']}, "
         f"torch {machine['torch']}, the MLP's products through {machine.get('kernel', 'an unrecorded kernel')}; "
         f"load average at start {machine['load']} (a shared machine: timings are noisy).",
         f"- This invocation: {cfg.workers} process(es), {runner.computed} run(s) computed, {runner.reused} "
         f"reused" + (f", {len(runner.failed)} FAILED" if runner.failed else "") + "."]
    L += [f"- Wall time, {k}: {v:.0f} s" for k, v in timings.items()]
    rows = read_timing_log(cfg.out)
    if rows:
        L += ["", "| started | processes | runs computed | wall | gradients/s (all processes) | bare loop steps/s "
                  "(1 process) |", "|---|---|---|---|---|---|"]
        for r in rows:
            rate = r["gradients"] / r["seconds"] if r.get("seconds") else math.nan
            L.append(f"| {r['started']} | {r['workers']} | {r['computed']} | {r['seconds'] / 60:.1f} min | "
                     f"{rate:.0f} | {_f(r.get('bare_steps_per_s'), '.0f')} |")
        L += ["", f"- **Whole study: {sum(r['seconds'] for r in rows) / 60:.1f} min of wall time over {len(rows)} "
                  "invocation(s) that computed runs.**"]
    recs = [r for c in runner.cells for r in c.sweep.results.values()]
    L.append(f"- Sum of the stored runs' own wall times: {sum(r.get('wall_total', 0.0) for r in recs) / 60:.1f} min "
             f"over {len(recs)} runs.")
    return L


def grid_lines(cfg: PopulationConfig, runner: Runner) -> list[str]:
    L = ["Final training loss of seed 0 at each grid value († diverged: counted as ∞):", "",
         "| setting | method | final loss per value (seed 0) | chosen | choice |", "|---|---|---|---|---|"]
    for c in runner.cells:
        sw = c.sweep
        cells = []
        for a in sw.alphas:
            r = sw.results.get((a, 0))
            text = ("failed" if (a, 0) in sw.failed else "not run") if r is None else \
                f"{r['final_loss']:.4g}{'†' if r.get('diverged') else ''}"
            cells.append(f"{a:g}: {text}")
        chosen = f"{c.method.knob_label()} = {sw.chosen:g}" if sw.chosen is not None else "—"
        L.append(f"| {c.setting.label} | {c.method.label} | {', '.join(cells)} | {chosen} | {sw.note} |")
    return L


def result_lines(cfg: PopulationConfig, res: Results, figures: list[Path]) -> list[str]:
    L = ["Medians over seeds at each method's chosen value; final training loss with [min, max] over seeds. "
         "Worst client: the largest final client loss. Updates: model updates applied; lost: jobs lost to a "
         "client going offline; idle: mean share of time a client sat idle (online or not).", "",
         "Table also in `results.csv`."]
    figs = {p.stem.removeprefix("fig_"): p.name for p in figures}
    for s in cfg.settings:
        rows = res.summary.get(s.label)
        if not rows:
            continue
        L += ["", f"### {s.title} (`{s.label}`)", "",
              "| method | tuned | final loss [min, max] | worst client | test accuracy | updates | lost | idle | seeds |",
              "|---|---|---|---|---|---|---|---|---|"]
        for m in cfg.methods:
            x = rows.get(m.name)
            if not x or not x["n"]:
                continue
            name = f"**{m.label}**" if m.name == RATE else m.label
            div = f" ({x['diverged']} diverged)" if x["diverged"] else ""
            L.append(f"| {name} | {m.knob_label()} = {res.chosen[s.label][m.name]:g} | {_f(x['loss_med'])} "
                     f"[{_f(x['loss_min'])}, {_f(x['loss_max'])}]{div} | {_f(x['worst'])} | {_f(x['acc'], '.2%')} | "
                     f"{_f(x['updates'], '.0f')} | {_f(x['lost'], '.0f')} | {_f(x['idle'], '.1%')} | {x['n']} |")
        if s.label in figs:
            L += ["", f"![{s.title}]({figs[s.label]})"]
    return L


def _label(method: str) -> str:
    return BY_NAME[method].label


def _line(v: Verdict) -> str:
    spec = ".2%" if v.metric == "acc" else ".4g"
    seeds = "" if v.overlap is None else ("; the seeds' ranges overlap" if v.overlap else "; the seeds' ranges are apart")
    return (f"- `{v.setting}`, {v.what}: Rescaled(rate) {_f(v.rate, spec)}, best other method "
            f"{_label(v.best_method)} {_f(v.best, spec)}{seeds}.")


def unstable_lines(res: Results) -> list[str]:
    if not res.unstable:
        return []
    return ["", "Choices that did not carry over to the other seeds (a seed ends above twice seed 0's final loss, "
                "so the median reflects the value's instability more than the method's): "
            + "; ".join(f"`{s}` {_label(m)} (seed 0 {a:.4g}, worst other seed {b:.4g})" for s, m, a, b in res.unstable)
            + "."]


def verdict_lines(verdicts: list[Verdict], same_runs: list[str]) -> list[str]:
    """The three verdict sections, each listing exactly the (setting, metric) pairs of its outcome."""
    count = {o: sum(v.outcome == o for v in verdicts) for o in ("wins", "ties", "loses")}
    apart = sum(v.overlap is False for v in verdicts)
    L = ["## Verdicts: Rescaled(rate) against the best other method", "",
         "For every setting and metric, Rescaled(rate)'s median over seeds against the best median of the other "
         "five methods (computed from the table, not written by hand). "
         f"**In short:** it wins {count['wins']}, ties {count['ties']} and loses {count['loses']} of "
         f"{len(verdicts)} comparisons; in {apart} of them the two methods' ranges over seeds are apart, in the "
         "others they overlap (the difference is within the seed-to-seed spread)."]
    if same_runs:
        L += ["", "Rescaled(rate) and Rescaled(τ) gave the same runs (same chosen α, same final loss for every seed) in "
                  + ", ".join(f"`{s}`" for s in same_runs) + ": runs computed before the engine estimated the "
                  "delivery periods at C = N with an availability model (it took τ_i, as if every client were "
                  "always online)."]
    for title, outcome, none in (("## Where Rescaled(rate) wins", "wins", "nowhere"),
                                 ("## Where Rescaled(rate) ties (its number equals the best other's)", "ties", "nowhere"),
                                 (NOT_WIN, "loses", "nowhere: it is never worse than the best other method")):
        L += ["", title, ""]
        if outcome == "loses":
            L += ["Where its number is worse than the best other method's:", ""]
        rows = [_line(v) for v in verdicts if v.outcome == outcome]
        L += rows or [f"- {none}."]
    return L
