"""The paper's MNIST study: ``python run_sim.py paper [--quick]``.

For every method (Rescaled, Malenia and Ringleader ASGD, plus Vanilla and Delay-Adaptive ASGD as
extra rows) and every compute-time setting (fixed, exponential):

1. sweep the cycle stepsize α over the grid (default {1e-4, …, 1}) with seed 0 at the budget;
2. while the best α (lowest final training loss; a diverged run counts as +inf) sits at an edge of
   the grid, extend the grid past that edge (×10 below 1, half-decades 3, 10, 30, … above 1) until
   the choice is interior or the extension cap is reached;
3. run the remaining seeds at the chosen α.

Every finished run is stored as ``out/runs/<setting>/<method>/lr<α>_seed<s>.csv`` (its evaluation
history) and ``….json`` (the outcome without the history); a run whose JSON exists (same budget and
evaluation period) is not recomputed. Then the two toy problems are run, and the figures
(``out/fig_*.png``), curve CSVs (``out/curves/``) and ``out/REPORT.md`` are written.

The modules, in the order the study uses them:

- ``study``: ``main(argv)``, the stages one after the other;
- ``config``: ``StudyConfig``, the methods and settings, the command line;
- ``sweep``: one (setting, method)'s α grid, its extension and the choice;
- ``runner``: which runs are needed, batching, the process pool;
- ``storage``: the run records on disk, atomic writes, reuse of finished runs;
- ``toys``: the quadratic toy runs and the staleness statistics;
- ``summaries``: per-method numbers over seeds and the curves;
- ``figures``: the PNGs;
- ``claims``: the paper's claims checked against the numbers (data, no prose);
- ``report``: ``REPORT.md``, worded from the summaries and the claims;
- ``timing``: the machine, the bare-loop yardstick, ``timing.jsonl``.
"""

from .claims import ClaimsCheck, Verdict, check_claims
from .config import LABELS, METHODS, PAPER_METHODS, SETTINGS, StudyConfig, build_parser, config_from_args
from .runner import Runner, execute_batch
from .study import main
from .summaries import Results, band, collect, summarize
from .sweep import RunKey, Sweep, clean, fmt_lr, next_down, next_up, score
from .timing import bare_loop_rate, machine_info
from .toys import TOY1, TOY2, cycle_iterates, run_quadratic, run_toy, staleness, toy_fixed_points

__all__ = [
    "LABELS", "METHODS", "PAPER_METHODS", "SETTINGS", "TOY1", "TOY2",
    "ClaimsCheck", "Results", "RunKey", "Runner", "StudyConfig", "Sweep", "Verdict",
    "band", "bare_loop_rate", "build_parser", "check_claims", "clean", "collect", "config_from_args",
    "cycle_iterates", "execute_batch", "fmt_lr", "machine_info", "main", "next_down", "next_up", "run_quadratic",
    "run_toy", "score", "staleness", "summarize", "toy_fixed_points",
]
