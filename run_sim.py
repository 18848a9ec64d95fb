#!/usr/bin/env python
"""Command line for fl-rescaled simulations.

    python run_sim.py                      # the embedded default: Rescaled vs Vanilla ASGD on MNIST
    python run_sim.py --task quadratic --taus 1,2 --quad-a 1,2 --quad-b 4,-3 --lr 0.01 --budget 4000
    python run_sim.py --strategy vanilla --delays exponential --budget 30000 --out runs/x --json

Lists are comma-separated. Bad flags or values exit with status 2 and a one-line error.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

DEFAULT_BUDGET = 12000.0
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
    from strategies import STRATEGIES

    p = _Parser(description="Asynchronous SGD on Flower: Rescaled ASGD and baselines (virtual time).")
    p.add_argument("--task", default="mnist", help="mnist | quadratic (default mnist)")
    p.add_argument("--strategy", default=None,
                   help=f"{' | '.join(STRATEGIES)} (default: rescaled and vanilla, compared)")
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
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def specs_from_args(args: argparse.Namespace) -> list[Any]:
    from fl_rescaled.experiment import RunSpec

    default_run = args.strategy is None
    strategies = ["rescaled", "vanilla"] if default_run else [args.strategy]
    specs = []
    for name in strategies:
        spec = RunSpec(
            task=args.task, strategy=name, lr=args.lr if args.lr is not None else DEFAULT_LR,
            delays=args.delays, taus=args.taus, num_clients=args.num_clients,
            budget=args.budget if args.budget is not None else DEFAULT_BUDGET, seed=args.seed,
            eval_every=args.eval_every, weights=args.weights, batch_size=args.batch_size,
            dirichlet_alpha=args.dirichlet_alpha, data_dir=args.data_dir, quad_a=args.quad_a,
            quad_b=args.quad_b, quad_dim=args.quad_dim, quad_x0=args.quad_x0, noise=args.noise,
            delay_rule=args.delay_rule, out=args.out,
            progress=not args.no_progress and sys.stderr.isatty(),
        )
        specs.append(spec.resolved())
    return specs


def print_table(outcomes: list[dict[str, Any]]) -> None:
    head = f"{'strategy':<16}{'α':>8}{'updates':>10}{'final loss':>12}{'accuracy':>10}{'worst client':>14}{'wall s':>8}"
    print(head)
    print("-" * len(head))
    for o in outcomes:
        acc = o.get("accuracy")
        worst = max(o["client_losses"]) if o.get("client_losses") else float("nan")
        print(f"{o['strategy']:<16}{o['lr']:>8g}{o['num_updates']:>10}{o['final_loss']:>12.4f}"
              f"{(acc if acc is not None else float('nan')):>10.4f}{worst:>14.4f}{o['wall_seconds']:>8.1f}")
        if o["task"] == "quadratic":
            print(f"{'':<16}final x = {o['final_params']}, equal-weight minimiser x* = {o['minimizer']:.6g}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR,
                        format="%(levelname)s %(name)s: %(message)s")
    for name in ("flwr",):
        logging.getLogger(name).setLevel(logging.INFO if args.verbose else logging.ERROR)
    try:
        specs = specs_from_args(args)
    except ValueError as exc:
        sys.stderr.write(f"run_sim.py: error: {exc}\n")
        return 2
    from fl_rescaled.experiment import run, to_json

    outcomes = []
    for spec in specs:
        if not args.json:
            print(f"running {spec.strategy} on {spec.task}: α={spec.lr:g}, {spec.delays} τ={spec.taus}, "
                  f"budget={spec.budget:g}", flush=True)
        outcomes.append(run(spec))
    if outcomes and outcomes[0].get("data_source") and not args.json:
        print(f"MNIST source: {outcomes[0]['data_source']}")
    print_table(outcomes)
    for o in outcomes:
        if o.get("csv"):
            print(f"wrote {o['csv']} and {o['png']}")
    if args.json:
        print(to_json(outcomes[-1]) if len(outcomes) == 1 else "[" + ",".join(to_json(o) for o in outcomes) + "]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
