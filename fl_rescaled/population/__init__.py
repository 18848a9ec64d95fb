"""A study beyond the paper: ``python run_sim.py population [--quick] [--out DIR] [--workers N] [--report-only]``.

A population of 100 MNIST clients with label skew (Dirichlet 0.1, or one class per client), lognormal
compute speeds and a daily availability cycle, at most C ∈ {10, 100} training at a time. Six methods
(FedAvg, FedBuff, FedAsync, Vanilla ASGD, Rescaled(τ), Rescaled(rate)) run at equal virtual time;
each method's learning rate is chosen per setting on seed 0, then more seeds run at that value. The
report (``REPORT.md``) gives final training loss, worst client's loss and test accuracy per setting,
accuracy against virtual time, and where Rescaled(rate) wins, ties and does not win, computed from
the numbers.

Modules, in the order the study uses them: ``config`` (the population model, settings, methods,
``spec_for``: every run is a ``RunSpec``, the MNIST partition the core's ``mix``),
``runner`` (sweeps, the process pool, stored runs), ``results`` (summaries, curves, verdicts),
``figures``, ``report``, ``study`` (``main``). It reuses the paper study's sweep, storage, pool
initialiser and timing helpers (``fl_rescaled.paper``).
"""

from .config import FULL, METHODS, MODEL, QUICK, SETTINGS, Method, PopulationConfig, Setting, config_from_args, spec_for
from .results import Verdict, verdicts
from .runner import Runner, half_step
from .study import main

__all__ = ["FULL", "METHODS", "MODEL", "QUICK", "SETTINGS", "Method", "PopulationConfig", "Runner", "Setting",
           "Verdict", "config_from_args", "half_step", "main", "spec_for", "verdicts"]
