"""The command line for fl-rescaled simulations (``run_sim.py`` in the source tree, ``fl-rescaled-sim``
when installed).

    python run_sim.py                      # the embedded default: Rescaled vs Vanilla ASGD on MNIST
    python run_sim.py --task quadratic --taus 1,2 --quad-a 1,2 --quad-b 4,-3 --lr 0.01 --budget 4000
    python run_sim.py --strategy vanilla --delays exponential --budget 30000 --out runs/x --json
    python run_sim.py --strategy fedbuff --fedbuff-buffer-size 5 --reply model --local-steps 3
    python run_sim.py paper [--quick]      # the paper's MNIST study (see fl_rescaled/paper)

Every flag is derived from where its option is declared: a ``RunSpec`` field (``--budget``) or a
strategy constructor's keyword (``--jobs-per-node`` for every strategy, ``--fedbuff-buffer-size``
for one). Lists are comma-separated. Bad flags or values exit with status 2 and a one-line error;
a run that cannot make progress exits with status 1 and the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import warnings
from typing import Any

import numpy as np

from . import experiment, flower_sim, paper, population
from .checkpoints import CheckpointError
from .data import DataUnavailable
from .data.partition import PartitionError
from .errors import RunFailed, one_line
from .reporting import rejected_lines
from .manager import ManagerSettings
from .runspec import RunSpec, ignored_lines, manager_settings, run_settings
from .settings import Setting
from .strategies import STRATEGIES, options

#: Flags of RunSpec fields handled by the command line itself.
_SPECIAL = {"strategy", "options"}
#: The most seeds one ``--seeds`` runs.
MAX_SEEDS = 100


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        sys.stderr.write(f"run_sim.py: error: {one_line(message)}\n")
        raise SystemExit(2)


def _typed(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None

    return convert


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: distinct comma-separated seeds, each a valid ``--seed``, at most ``MAX_SEEDS``."""
    seed = dataclasses.replace(next(f for f in run_settings() if f.name == "seed"), key="seeds")
    seeds = [seed.parse(item) for item in str(text).split(",")]
    if len(set(seeds)) != len(seeds) or len(seeds) > MAX_SEEDS:
        raise ValueError(f"--seeds: expected at most {MAX_SEEDS} distinct seeds, got {text!r}")
    return seeds


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description="Asynchronous SGD on Flower: Rescaled ASGD and baselines (in-process, virtual time).")
    p.add_argument("--strategy", default=None,
                   help=f"{' | '.join(STRATEGIES)} | all (default: rescaled and vanilla, compared)")
    run = p.add_argument_group("the run (RunSpec)")
    for f in run_settings():
        if f.name not in _SPECIAL:
            _add_option(run, f)
    manager = p.add_argument_group("the client manager (ManagerSettings)")
    for f in manager_settings():
        _add_option(manager, f)
    common = p.add_argument_group("options of every strategy (AsyncStrategy)")
    for o in options.common_options():
        if o.name != "lr":  # (a RunSpec field)
            _add_option(common, o)
    for name in STRATEGIES:
        own = options.strategy_options(name)
        if own:
            group = p.add_argument_group(f"options of {name} ({STRATEGIES[name].__name__})")
            for o in own:
                _add_option(group, o)
    p.add_argument("--seeds", type=_typed(parse_seeds), default=None, metavar="LIST",
                   help="run each strategy once per seed (comma-separated, instead of --seed) and end with each "
                        "strategy's median and min-max over the seeds")
    p.add_argument("--engine", default="inprocess",
                   help="inprocess (default: our in-process Grid) | flower (Flower's Simulation Engine)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="the strategies' and Flower's INFO log")
    return p


def _add_option(group, o: Setting) -> None:
    """A flag whose destination says whose setting it is: ``run:eval_every``, ``manager:tau_smoothing``,
    ``opt::jobs_per_node`` (every strategy), ``opt:fedbuff:buffer_size``."""
    default = f" (default {o.default})" if o.default not in (None, "", False) else ""
    dest = (f"{o.owner}:{o.name}" if o.owner in ("run", "manager")
            else f"opt:{'' if o.owner == 'common' else o.owner}:{o.name}")
    if o.kind == "bool":
        group.add_argument(f"--{o.key}", dest=dest, action="store_true", default=None, help=o.help + default)
    else:
        group.add_argument(f"--{o.key}", dest=dest, type=_typed(o.parse), default=None, metavar=o.kind.upper(),
                           help=o.help + default)


def specs_from_args(args: argparse.Namespace) -> list[RunSpec]:
    """One resolved ``RunSpec`` per strategy asked for, from the flags that were given."""
    if args.strategy is None:
        names = ["rescaled", "vanilla"]
    elif args.strategy == "all":
        names = list(STRATEGIES)
    elif args.strategy in STRATEGIES:
        names = [args.strategy]
    else:
        raise ValueError(f"unknown strategy {args.strategy!r}; choose one of {', '.join(STRATEGIES)} or all")
    given = {k: v for k, v in vars(args).items() if v is not None}
    if args.seeds is not None and "run:seed" in given:
        raise ValueError("give --seed or --seeds, not both")
    fields = {key.split(":")[1]: v for key, v in given.items() if key.startswith("run:")}
    fields["manager"] = ManagerSettings(**{key.split(":")[1]: v for key, v in given.items()
                                           if key.startswith("manager:")})
    chosen = set(names)
    for key in given:
        if key.startswith("opt:") and key.split(":")[1] and key.split(":")[1] not in chosen:
            raise ValueError(f"--{key.split(':')[1]}-… options apply to strategy {key.split(':')[1]!r}, "
                             f"which this run does not use")
    specs = []
    seeds = [fields.pop("seed", 0)] if args.seeds is None else args.seeds
    for seed in seeds:
        for name in names:
            opts = {key.split(":")[2]: v for key, v in given.items()
                    if key.startswith("opt:") and key.split(":")[1] in ("", name)}
            tag = f"-seed{seed}" if args.seeds is not None else ""
            spec = RunSpec(strategy=name, options=opts, progress=not args.no_progress and sys.stderr.isatty(),
                           checkpoint_name=f"run-{name}{tag}.ckpt" if len(names) * len(seeds) > 1 else None,
                           seed=seed, **fields)
            specs.append(experiment.resolve(spec))
    return specs


def print_table(outcomes: list[dict[str, Any]]) -> None:
    """One row per run: loss, accuracy, updates, discarded jobs, idle share, the model-sized vectors
    the server held (the model included: ``stored_vectors_max`` + 1), wall time; each run's seed
    after its strategy when the runs have several."""
    quad = outcomes[0]["task"] == "quadratic"
    metric = "|x - x*|" if quad else "accuracy"
    several = len({o["seed"] for o in outcomes}) > 1
    label = {id(o): f"{o['strategy']} (seed {o['seed']})" if several else o["strategy"] for o in outcomes}
    width = max(16, 2 + max(map(len, label.values())))
    head = (f"{'strategy':<{width}}{'α':>7}{'final loss':>12}{metric:>10}{'worst client':>14}{'updates':>9}"
            f"{'rejected':>9}{'discarded':>10}{'idle':>7}{'vectors':>9}{'wall s':>8}")
    print(head)
    print("-" * len(head))
    for o in outcomes:
        extra = o.get("dist") if quad else o.get("accuracy")
        worst = o["worst_client_loss"] if o.get("worst_client_loss") is not None else float("nan")
        idle = o["idle_share_mean"]
        print(f"{label[id(o)]:<{width}}{o['lr']:>7g}{o['final_loss']:>12.4g}{(extra if extra is not None else float('nan')):>10.4g}"
              f"{worst:>14.4g}{o['num_updates']:>9}{o['books']['rejected']:>9}{o['books']['discarded']:>10}{idle:>7.1%}"
              f"{o['stored_vectors_max'] + 1:>9}{o['wall_seconds']:>8.1f}")
    print("final loss: the training objective (the clients' weighted mean loss) at the end; "
          + ("|x - x*|: the distance to the equal-weight minimiser" if quad else "accuracy: on the test set")
          + "; worst client: the largest client's final loss; updates: server updates applied; rejected: replies "
          "that failed validation; discarded: finished or cancelled jobs whose work was thrown away; idle: mean share "
          "of time a worker sat idle; vectors: most model-sized vectors the server held at once, the model included "
          "(1: the model only); wall s: this run's seconds on this machine")
    if quad:
        for o in outcomes:
            print(f"  {label[id(o)]:<{width - 2}} final x = {[round(v, 6) for v in o['final_params']]}")
        print(f"  equal-weight minimiser x* = {outcomes[0]['minimizer']:.6g}")


def print_seed_table(outcomes: list[dict[str, Any]]) -> None:
    """``--seeds``: per strategy, the median and min-max over the seeds of the final loss, the test
    accuracy (the quadratic task: |x - x*|) and the worst client's loss."""
    quad = outcomes[0]["task"] == "quadratic"
    columns = [("final loss", "final_loss"), ("|x - x*|", "dist") if quad else ("accuracy", "accuracy"),
               ("worst client", "worst_client_loss")]
    seeds = sorted({o["seed"] for o in outcomes})
    print(f"\n{len(seeds)} seeds ({', '.join(map(str, seeds))}): median [min - max] per strategy")
    head = f"{'strategy':<16}" + "".join(f"{title:>28}" for title, _ in columns)
    print(head)
    print("-" * len(head))
    for name in dict.fromkeys(o["strategy"] for o in outcomes):
        cells = []
        for _, key in columns:
            v = np.array([o.get(key) if o.get(key) is not None else np.nan for o in outcomes if o["strategy"] == name])
            cells.append(f"{np.median(v):.4g} [{v.min():.4g} - {v.max():.4g}]")
        print(f"{name:<16}" + "".join(f"{c:>28}" for c in cells))


def _taus_text(taus: list[float] | None) -> str:
    """The clients' τ for the log line: every value for a few clients, else their count and range."""
    if taus is None or len(taus) <= 12:
        return f"τ={taus}"
    return f"τ from {min(taus):g} to {max(taus):g} ({len(taus):,} clients)"


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[RunSpec]]:
    """The flags and the runs they ask for; a bad flag or value writes one line to stderr and
    raises ``SystemExit(2)``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        specs = specs_from_args(args)
        if args.engine not in ("inprocess", "flower"):
            raise ValueError(f"unknown engine {args.engine!r}; choose inprocess or flower")
    except ValueError as exc:
        parser.error(str(exc))
    given = {key.rsplit(":", 1)[1] for key, v in vars(args).items()  # (run, manager and common strategy options)
             if v is not None and key.startswith(("run:", "manager:", "opt::"))}
    for line in ignored_lines([(spec, experiment.make_strategy(spec)) for spec in specs], given,
                              lambda name: f"--{name.replace('_', '-')}"):  # a flag that changes nothing
        sys.stderr.write(f"run_sim.py: warning: {line}\n")
    return args, specs


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """A Python warning (numpy's overflow in a client's arithmetic, say) as one line on stderr."""
    sys.stderr.write(f"run_sim.py: warning: {one_line(message)} ({category.__name__}, "
                     f"{filename.rsplit('/', 1)[-1]}:{lineno})\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "paper":  # the paper's study: python run_sim.py paper [--quick] ...
        return paper.main(argv[1:])
    if argv and argv[0] == "population":  # a population study: python run_sim.py population [--quick] ...
        return population.main(argv[1:])
    args, specs = parse(argv)
    try:
        for spec in specs:  # before any work: a bad --out fails now, not after the run
            spec.prepare_out()
    except ValueError as exc:
        sys.stderr.write(f"run_sim.py: error: {one_line(exc)}\n")
        return 2
    warnings.showwarning = _warning_line
    for name in ("flwr", "flwr.fl_rescaled"):  # (our loggers are Flower's children: its handler, its format)
        logging.getLogger(name).setLevel(logging.INFO if args.verbose else logging.ERROR)
    for spec in specs:
        if not args.json:
            print(f"{'queued' if args.engine == 'flower' else 'running'} {spec.strategy} on {spec.task}"
                  f"{f' (seed {spec.seed})' if args.seeds is not None else ''}: "
                  f"α={'the run’s default' if spec.lr is None else format(spec.lr, 'g')}, {spec.delays} "
                  f"{_taus_text(spec.taus)}, budget={spec.budget:g}", flush=True)
    try:
        if args.engine == "flower":  # one Flower simulation (one Ray start) for all the runs
            outcomes = flower_sim.run_many_on_flower(specs)
        else:
            outcomes = [experiment.run(spec) for spec in specs]
    except (RunFailed, flower_sim.FlowerRunError) as exc:
        if isinstance(exc.__cause__, (DataUnavailable, PartitionError)):  # (on Flower's engine: the ServerApp's)
            sys.stderr.write(f"run_sim.py: error: {one_line(exc.__cause__)}\n")
            return 2
        sys.stderr.write(f"run_sim.py: run failed: {one_line(exc)}\n")
        return 1
    except (CheckpointError, DataUnavailable, PartitionError) as exc:
        sys.stderr.write(f"run_sim.py: error: {one_line(exc)}\n")
        return 2
    if outcomes and outcomes[0].get("data_source") and not args.json:
        print(f"MNIST source: {outcomes[0]['data_source']}")
    print_table(outcomes)
    if args.seeds is not None:
        print_seed_table(outcomes)
    sys.stdout.flush()
    for o in outcomes:  # a client none of whose replies was used, named (one line each)
        found = [(d["client"], d["rejected"], d["reasons"]) for d in o.get("all_rejected", [])]
        for line in rejected_lines(found, lambda w, name=o["strategy"]: f"{name}: client {w}"):
            sys.stderr.write(f"run_sim.py: warning: {line}\n")
    for o in outcomes:
        if o.get("csv"):
            print(f"wrote {o['csv']} and {o['png']}")
    if args.json:
        print(experiment.to_json(outcomes[-1]) if len(outcomes) == 1
              else "[" + ",".join(experiment.to_json(o) for o in outcomes) + "]")
    return 0


if __name__ == "__main__":  # python -m fl_rescaled.cli
    sys.exit(main())
