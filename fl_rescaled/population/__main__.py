"""``python -m fl_rescaled.population [--quick] ...``: the same as ``python run_sim.py population ...``."""

import sys

from .study import main

sys.exit(main(sys.argv[1:]))
