#!/usr/bin/env python
"""Command line for fl-rescaled simulations and experiments (``fl_rescaled/cli.py``).

    python run_sim.py                      # the embedded default: Rescaled vs Vanilla ASGD on MNIST
    python run_sim.py --strategy rescaled --budget 30000 --lr 1 --out runs/rescaled --json
    python run_sim.py --task quadratic --taus 1,2 --quad-a 1,2 --quad-b 4,-3 --lr 0.01 --budget 4000
    python run_sim.py paper [--quick]      # the paper's MNIST study
    python run_sim.py --help               # every flag

Installed, the same command is ``fl-rescaled-sim``.
"""

import sys

from fl_rescaled.cli import main

if __name__ == "__main__":
    sys.exit(main())
