"""The command line for fl-rescaled simulations (``run_sim.py`` in the source tree, ``fl-rescaled-sim``
when installed).

    python run_sim.py                      # the embedded default: Rescaled vs Vanilla ASGD on MNIST
    python run_sim.py --task quadratic --taus 1,2 --quad-a 1,2 --quad-b 4,-3 --lr 0.01 --budget 4000
    python run_sim.py --strategy vanilla --delays exponential --budget 30000 --out runs/x --json
    python run_sim.py paper [--quick]      # the paper's MNIST study (see fl_rescaled/paper.py)

Lists are comma-separated. Bad flags or values exit with status 2 and a one-line error; a run that
cannot make progress exits with status 1 and the reason.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from . import RunFailed

DEFAULT_BUDGET = 10000.0
DEFAULT_LR = 1.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        sys.stderr.write(f"run_sim.py: error: {message}\n")
        raise SystemExit(2)


def _floats(text: str) -> list[float]:
    try:
        vals = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("empty list")
    return vals


def build_parser() -> argparse.ArgumentParser:
    from fl_rescaled.strategies import STRATEGIES

    p = _Parser(description="Asynchronous SGD on Flower: Rescaled ASGD and baselines (virtual time).")
    p.add_argument("--task", default="mnist", help="mnist | quadratic (default mnist)")
    p.add_argument("--strategy", default=None,
                   help=f"{' | '.join(STRATEGIES)} | all (default: rescaled and vanilla, compared)")
    p.add_argument("--delays", default="fixed", help="fixed | exponential compute times (default fixed)")
    p.add_argument("--taus", type=_floats, default=None, help="compute time per client (default 1,1,2,2,4,4,...)")
    p.add_argument("--num-clients", type=int, default=None, help="number of clients (default len(taus) or 10)")
    p.add_argument("--lr", type=float, default=None, help=f"cycle stepsize α (default {DEFAULT_LR:g})")
    p.add_argument("--budget", type=float, default=None, help=f"simulated time budget (default {DEFAULT_BUDGET:g})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=float, default=None, help="evaluation period (default budget/200)")
    p.add_argument("--weights", type=_floats, default=None, help="target weights w_i (sum to 1; default 1/n)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dirichlet-alpha", type=float, default=0.0, help="label skew; 0 = one class per client")
    p.add_argument("--data-dir", default=None, help="folder with the MNIST IDX files (else cache / download)")
    p.add_argument("--out", default=None, help="folder for the CSV and PNG outputs")
    p.add_argument("--quad-a", type=_floats, default=None, help="quadratic curvatures a_i")
    p.add_argument("--quad-b", type=_floats, default=None, help="quadratic minimisers b_i")
    p.add_argument("--quad-dim", type=int, default=1)
    p.add_argument("--quad-x0", type=float, default=0.0, help="quadratic starting point (every coordinate)")
    p.add_argument("--noise", type=float, default=0.0, help="Gaussian gradient noise σ (quadratic)")
    p.add_argument("--delay-rule", default="inverse", help="delay-adaptive rule: inverse | authors")
    t = p.add_argument_group("transport and time")
    t.add_argument("--engine", default="inprocess",
                   help="inprocess (default: our in-process Grid) | flower (Flower's Simulation Engine)")
    t.add_argument("--clock", default="virtual", help="virtual (simulated time) | wall (arrival order)")
    t.add_argument("--time-unit", type=float, default=1.0, help="wall clock: seconds per time unit (1)")
    t.add_argument("--emulate", default="", help="wall clock: fixed | exponential emulated compute times")
    t.add_argument("--tau-estimator", default="interval", help="wall clock: interval | compute (interval)")
    t.add_argument("--ttl", type=float, default=3600.0, help="seconds before a job counts as lost (3600)")
    t.add_argument("--jobs-per-node", type=int, default=1, help="wall clock: jobs in flight per node (1)")
    t.add_argument("--reply", default=None,
                   help="gradient | model: what the ClientApp replies with (default: the method's; model = "
                        "local training, a FedAvg-style reply)")
    t.add_argument("--local-lr", type=float, default=None,
                   help="local training's learning rate (default: the α convention, see the README)")
    g = p.add_argument_group("options of the comparison methods")
    g.add_argument("--malenia-s", type=float, default=None, help="Malenia's S (default: every worker ≥ 1 gradient)")
    g.add_argument("--ringleader-restart", action="store_true",
                   help="Ringleader: restart non-triggering workers on the current model (the public code)")
    g.add_argument("--concurrency", type=int, default=None, help="Concurrent ASGD's jobs in flight τ_C (n)")
    g.add_argument("--local-steps", type=int, default=1, help="FedAsync H / FedBuff Q local SGD steps (1)")
    g.add_argument("--fedasync-mixing", type=float, default=0.6, help="FedAsync mixing weight (0.6)")
    g.add_argument("--fedasync-staleness", default="polynomial", help="constant | polynomial | hinge")
    g.add_argument("--fedbuff-buffer", type=int, default=3, help="FedBuff buffer size K (3)")
    g.add_argument("--staleness-exponent", type=float, default=0.5, help="FedBuff's p in 1/(1+δ)^p (0.5)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def specs_from_args(args: argparse.Namespace) -> list[Any]:
    from fl_rescaled.experiment import RunSpec

    from fl_rescaled.strategies import STRATEGIES

    if args.strategy is None:
        strategies = ["rescaled", "vanilla"]
    elif args.strategy == "all":
        strategies = list(STRATEGIES)
    else:
        strategies = [args.strategy]
    specs = []
    for name in strategies:
        spec = RunSpec(
            task=args.task, strategy=name, lr=args.lr if args.lr is not None else DEFAULT_LR,
            delays=args.delays, taus=args.taus, num_clients=args.num_clients,
            budget=args.budget if args.budget is not None else DEFAULT_BUDGET, seed=args.seed,
            eval_every=args.eval_every, weights=args.weights, batch_size=args.batch_size,
            dirichlet_alpha=args.dirichlet_alpha, data_dir=args.data_dir, quad_a=args.quad_a,
            quad_b=args.quad_b, quad_dim=args.quad_dim, quad_x0=args.quad_x0, noise=args.noise,
            delay_rule=args.delay_rule, out=args.out, malenia_s=args.malenia_s,
            ringleader_restart=args.ringleader_restart, concurrency=args.concurrency, local_steps=args.local_steps,
            fedasync_mixing=args.fedasync_mixing, fedasync_staleness=args.fedasync_staleness,
            fedbuff_buffer=args.fedbuff_buffer, staleness_exponent=args.staleness_exponent,
            clock=args.clock, time_unit=args.time_unit, emulate=args.emulate, tau_estimator=args.tau_estimator,
            ttl=args.ttl, jobs_per_node=args.jobs_per_node, reply=args.reply, local_lr=args.local_lr,
            progress=not args.no_progress and sys.stderr.isatty(),
        )
        specs.append(spec.resolved())
    return specs


def print_table(outcomes: list[dict[str, Any]]) -> None:
    """One row per run: loss, accuracy, updates, discarded jobs, idle share, server memory, wall time."""
    quad = outcomes[0]["task"] == "quadratic"
    metric = "|x - x*|" if quad else "accuracy"
    head = (f"{'strategy':<16}{'α':>7}{'final loss':>12}{metric:>10}{'worst client':>14}{'updates':>9}"
            f"{'discarded':>10}{'idle':>7}{'memory':>8}{'wall s':>8}")
    print(head)
    print("-" * len(head))
    for o in outcomes:
        extra = o.get("dist") if quad else o.get("accuracy")
        worst = max(o["client_losses"]) if o.get("client_losses") else float("nan")
        idle = sum(o["idle_share_per_worker"]) / max(len(o["idle_share_per_worker"]), 1)
        print(f"{o['strategy']:<16}{o['lr']:>7g}{o['final_loss']:>12.4g}{(extra if extra is not None else float('nan')):>10.4g}"
              f"{worst:>14.4g}{o['num_updates']:>9}{sum(o['discarded_per_worker']):>10}{idle:>7.1%}"
              f"{o['stored_vectors_max']:>8}{o['wall_seconds']:>8.1f}")
    print("idle: mean share of time a worker sat idle; memory: most model-sized vectors the server held;"
          " discarded: finished or cancelled jobs whose work was thrown away")
    if quad:
        for o in outcomes:
            print(f"  {o['strategy']:<14} final x = {[round(v, 6) for v in o['final_params']]}")
        print(f"  equal-weight minimiser x* = {outcomes[0]['minimizer']:.6g}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "paper":  # the paper's study: python run_sim.py paper [--quick] ...
        from fl_rescaled.paper import main as paper_main

        return paper_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR,
                        format="%(levelname)s %(name)s: %(message)s")
    for name in ("flwr", "flwr.fl_rescaled"):
        logging.getLogger(name).setLevel(logging.INFO if args.verbose else logging.ERROR)
    try:
        specs = specs_from_args(args)
        if args.engine not in ("inprocess", "flower"):
            raise ValueError(f"unknown engine {args.engine!r}; choose inprocess or flower")
    except ValueError as exc:
        sys.stderr.write(f"run_sim.py: error: {exc}\n")
        return 2
    from fl_rescaled.experiment import to_json

    for spec in specs:
        if not args.json:
            print(f"{'queued' if args.engine == 'flower' else 'running'} {spec.strategy} on {spec.task}: "
                  f"α={spec.lr:g}, {spec.delays} τ={spec.taus}, budget={spec.budget:g}", flush=True)
    try:
        if args.engine == "flower":  # one Flower simulation (one Ray start) for all the runs
            from fl_rescaled.flower_sim import run_many_on_flower

            outcomes = run_many_on_flower(specs)
        else:
            from fl_rescaled.experiment import run

            outcomes = [run(spec) for spec in specs]
    except RunFailed as exc:
        sys.stderr.write(f"run_sim.py: run failed: {exc}\n")
        return 1
    if outcomes and outcomes[0].get("data_source") and not args.json:
        print(f"MNIST source: {outcomes[0]['data_source']}")
    print_table(outcomes)
    for o in outcomes:
        if o.get("csv"):
            print(f"wrote {o['csv']} and {o['png']}")
    if args.json:
        print(to_json(outcomes[-1]) if len(outcomes) == 1 else "[" + ",".join(to_json(o) for o in outcomes) + "]")
    return 0


if __name__ == "__main__":  # python -m fl_rescaled.cli
    sys.exit(main())
