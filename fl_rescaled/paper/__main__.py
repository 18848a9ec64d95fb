"""``python -m fl_rescaled.paper [--quick] ...``: the same as ``python run_sim.py paper ...``."""

import sys

from .study import main

sys.exit(main(sys.argv[1:]))
