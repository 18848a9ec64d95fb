"""The paper's claims (experiments.md, "Claims") checked against the numbers of one study.

Data only: each claim is a frozen dataclass with the numbers it compares, the yes/no answers of
its sub-checks and its ``Verdict`` (agrees: True or False; None while pending, when the numbers it
needs are not there: a method or setting left out, an unfinished sweep). ``report.py`` words them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fl_rescaled.clock import DEFAULT_TAUS

from .config import SETTINGS, StudyConfig
from .summaries import Results
from .sweep import Sweep
from .toys import ToyResults

UNCHANGED = (0.8, 1.25)  # claim 2: Rescaled's exponential / fixed loss ratio that counts as "virtually unchanged"
RIVALS = ("malenia", "ringleader")  # the methods the paper compares Rescaled ASGD with


@dataclass(frozen=True)
class Verdict:
    """One claim's answer: ``agrees`` True or False, None while pending; ``caveat`` qualifies it."""

    number: int
    claim: str
    agrees: bool | None
    caveat: str = ""


def _pending(number: int, claim: str) -> Verdict:
    return Verdict(number, claim, None)


CLAIM_1 = (1, "Rescaled below Malenia and Ringleader")
CLAIM_2_SLOWER = (2, "Malenia and Ringleader slow down under exponential times")
CLAIM_2_UNCHANGED = (2, "Rescaled virtually unchanged under exponential times")
CLAIM_3 = (3, "cumulative stepsize of Rescaled at α/τ_max")
CLAIM_4 = (4, "every chosen α interior to the grid")
CLAIM_5_TOY1 = (5, "toy τ=(1,2): Rescaled → x*, Vanilla → x̃*")
CLAIM_5_TOY2 = (5, "toy τ=(1,100): Delay-Adaptive → +1, Rescaled → 0")


# ------------------------------------------------------------ 1. Rescaled below Malenia and Ringleader
@dataclass(frozen=True)
class Rival:
    """Claim 1, one rival in one setting: its median final loss against Rescaled's."""

    method: str
    loss: float  # its median final loss
    rescaled_lower: bool
    ratio: float  # Rescaled's median final loss / its


@dataclass(frozen=True)
class LowerLossIn:
    """Claim 1 in one setting: Rescaled's median final loss and each rival's."""

    setting: str
    rescaled: float  # Rescaled's median final loss
    rivals: tuple[Rival, ...]


@dataclass(frozen=True)
class LowerLoss:
    """Claim 1, per setting with Rescaled; ``separated``: Rescaled's worst seed is below the rivals'
    best seed in every setting."""

    settings: tuple[LowerLossIn, ...]
    held: int
    compared: int
    separated: bool
    verdict: Verdict


def lower_loss(settings: list[str], res: Results) -> LowerLoss:
    rows, separated = [], []
    for s in settings:
        if not res.has(s, "rescaled"):
            continue
        x = res.summary[s]
        r = x["rescaled"]["loss_med"]
        rows.append(LowerLossIn(s, r, tuple(Rival(m, x[m]["loss_med"], r < x[m]["loss_med"], r / x[m]["loss_med"])
                                            for m in RIVALS if res.has(s, m))))
        others = [x[m]["loss_min"] for m in RIVALS if res.has(s, m)]
        if others:
            separated.append(x["rescaled"]["loss_max"] < min(others))
    lower = [v.rescaled_lower for row in rows for v in row.rivals]
    verdict = Verdict(*CLAIM_1, all(lower)) if lower else _pending(*CLAIM_1)
    return LowerLoss(tuple(rows), sum(lower), len(lower), all(separated), verdict)


# ------------------------------------------------------------ 2. exponential vs fixed compute times
@dataclass(frozen=True)
class Shift:
    """One method from fixed to exponential compute times (medians over seeds)."""

    method: str
    loss_fixed: float
    loss_exponential: float
    loss_ratio: float  # exponential / fixed; > 1 = worse under exponential times
    updates_fixed: float
    updates_exponential: float
    updates_ratio: float
    alpha_fixed: float
    alpha_exponential: float


@dataclass(frozen=True)
class Slowdown:
    """A rival's loss ratio against Rescaled's."""

    method: str
    ratio: float
    slower_than_rescaled: bool
    slower: bool  # ratio > 1


@dataclass(frozen=True)
class RescaledShift:
    """Claim 2: Rescaled's losses with exponential compute times against fixed ones, and the rivals'."""

    final_ratio: float  # of the median final losses
    curve_ratio: float  # median over the run's second half of the ratio of the two median loss curves
    unchanged: bool  # curve_ratio within UNCHANGED
    not_slower: bool  # curve_ratio ≤ UNCHANGED[1]
    staleness: dict[str, dict[str, Any]] | None  # setting → staleness statistics (both settings, or None)
    vanilla_ratio: float | None
    rivals: tuple[Slowdown, ...]


@dataclass(frozen=True)
class ExponentialTimes:
    """Claim 2: under exponential times Malenia and Ringleader slow down, Rescaled barely changes."""

    shifts: tuple[Shift, ...]
    rescaled: RescaledShift | None
    slower: Verdict
    unchanged: Verdict


def _curve_ratio(res: Results, default: float) -> float:
    """Rescaled's two median loss curves over the second half of the run: the median of their ratio
    (robust to the single-evaluation spikes of one-class data); ``default`` without both curves."""
    if "rescaled" not in res.loss.get("fixed", {}) or "rescaled" not in res.loss.get("exponential", {}):
        return default
    a, b = res.loss["fixed"]["rescaled"][0], res.loss["exponential"]["rescaled"][0]
    half = res.tgrid >= res.tgrid[-1] / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.exp(np.nanmedian(np.log(b[half] / a[half]))))


def exponential_times(methods: list[str], res: Results, toys: ToyResults) -> ExponentialTimes:
    shifts = []
    for m in methods:
        if res.has("fixed", m) and res.has("exponential", m):
            f, e = res.summary["fixed"][m], res.summary["exponential"][m]
            shifts.append(Shift(m, f["loss_med"], e["loss_med"],
                                e["loss_med"] / f["loss_med"] if f["loss_med"] > 0 else math.nan,
                                f["updates"], e["updates"], e["updates"] / f["updates"] if f["updates"] else math.nan,
                                res.chosen["fixed"][m], res.chosen["exponential"][m]))
    ratios = {sh.method: sh.loss_ratio for sh in shifts}
    if "rescaled" not in ratios:
        return ExponentialTimes(tuple(shifts), None, _pending(*CLAIM_2_SLOWER), _pending(*CLAIM_2_UNCHANGED))
    rr = ratios["rescaled"]
    mid = _curve_ratio(res, rr)
    close = UNCHANGED[0] <= mid <= UNCHANGED[1]
    stale = toys.staleness if all(toys.staleness.get(s) for s in SETTINGS) else None
    rivals = tuple(Slowdown(m, ratios[m], ratios[m] > rr, ratios[m] > 1) for m in RIVALS if m in ratios)
    shift = RescaledShift(rr, mid, close, mid <= UNCHANGED[1], stale, ratios.get("vanilla"), rivals)
    caveat = "" if close else f"it does {'better' if mid < 1 else 'worse'} there, median ratio {mid:.3g}"
    return ExponentialTimes(tuple(shifts), shift,
                            Verdict(*CLAIM_2_SLOWER, bool(rivals) and all(r.slower for r in rivals)),
                            Verdict(*CLAIM_2_UNCHANGED, close, caveat))


# ------------------------------------------------------------ 3. cumulative stepsize at α/τ_max
@dataclass(frozen=True)
class Slope:
    """Claim 3 in one setting: the measured slope of the cumulative stepsize against α/τ_max."""

    setting: str
    measured: float  # slope of the median cumulative stepsize over the run's second half
    expected: float  # α/τ_max
    ratio: float
    tolerance: float  # relative
    within: bool


@dataclass(frozen=True)
class CumulativeStepsize:
    """Claim 3: Rescaled ASGD's cumulative stepsize grows at the steady rate α/τ_max."""

    slopes: tuple[Slope, ...]
    verdict: Verdict


def cumulative_stepsize(settings: list[str], res: Results, tau_max: float) -> CumulativeStepsize:
    slopes = []
    tgrid = res.tgrid
    for s in settings:
        if "rescaled" not in res.cumstep.get(s, {}):
            continue
        c = res.cumstep[s]["rescaled"][0]
        half = tgrid >= tgrid[-1] / 2
        slope = float(np.polyfit(tgrid[half], c[half], 1)[0])
        expect = res.chosen[s]["rescaled"] / tau_max
        # Tolerance: 2 % (a window edge cuts a slow worker's step), plus for exponential times 3σ of the
        # Poisson noise of the deliveries in the window W: σ = sqrt(Σ τ_i / W) / n (relative).
        window = tgrid[-1] - tgrid[half][0]
        tol = 0.02 + (3 * math.sqrt(sum(DEFAULT_TAUS) / window) / len(DEFAULT_TAUS) if s == "exponential" else 0.0)
        slopes.append(Slope(s, slope, expect, slope / expect, tol, abs(slope / expect - 1) < tol))
    verdict = Verdict(*CLAIM_3, all(x.within for x in slopes)) if slopes else _pending(*CLAIM_3)
    return CumulativeStepsize(tuple(slopes), verdict)


# ------------------------------------------------------------ 4. chosen α interior to the grid
@dataclass(frozen=True)
class Choice:
    """Claim 4, one method in one setting: the α the sweep chose, and where it sits in the grid."""

    method: str
    setting: str
    alpha: float | None
    note: str  # "interior", an edge, "provisional: …", or "" (no choice yet)


@dataclass(frozen=True)
class InteriorChoice:
    """Claim 4: the chosen α are interior to the (extended) grid. A sweep without a final choice
    (unfinished study, ``--report-only``) is pending, not a disagreement."""

    choices: tuple[Choice, ...]
    verdict: Verdict


def interior_choice(sweeps: list[Sweep]) -> InteriorChoice:
    decided = [sw for sw in sweeps if sw.chosen is not None and not sw.provisional()]
    verdict = Verdict(*CLAIM_4, all(sw.note == "interior" for sw in decided)) if decided else _pending(*CLAIM_4)
    return InteriorChoice(tuple(Choice(sw.method, sw.setting, sw.chosen, sw.note) for sw in sweeps), verdict)


# ------------------------------------------------------------ 5. toy problems
@dataclass(frozen=True)
class ToyEnd:
    """Claim 5, one method on one toy: its final iterate against the point it should reach."""

    method: str
    x: float  # the final iterate
    target: float
    tolerance: float
    near: bool  # |x − target| < tolerance


@dataclass(frozen=True)
class ToyClaim:
    """Claim 5 on one toy: where each method's final iterate ends."""

    name: str
    ends: tuple[ToyEnd, ...]
    verdict: Verdict


def _end(toys: ToyResults, name: str, method: str, target: float, tol: float) -> ToyEnd:
    x = toys.final(name, method)
    return ToyEnd(method, x, target, tol, abs(x - target) < tol)


def toy_claims(toys: ToyResults) -> tuple[ToyClaim, ToyClaim]:
    fp = toys.fixed_points("toy1")
    ends1 = (_end(toys, "toy1", "rescaled", fp["equal"], 0.05), _end(toys, "toy1", "vanilla", fp["frequency"], 0.05))
    ends2 = (_end(toys, "toy2", "delay-adaptive", 1.0, 0.2), _end(toys, "toy2", "rescaled", 0.0, 0.1))
    return (ToyClaim("toy1", ends1, Verdict(*CLAIM_5_TOY1, all(e.near for e in ends1))),
            ToyClaim("toy2", ends2, Verdict(*CLAIM_5_TOY2, all(e.near for e in ends2))))


# ------------------------------------------------------------ all claims
@dataclass(frozen=True)
class ClaimsCheck:
    """Every claim of the paper's study, checked against the runs so far (``verdicts``)."""

    lower_loss: LowerLoss
    exponential: ExponentialTimes | None  # None unless the study has both settings
    stepsize: CumulativeStepsize | None  # None while no setting has Rescaled's runs
    interior: InteriorChoice
    toys: tuple[ToyClaim, ToyClaim]

    def verdicts(self) -> list[Verdict]:
        """Every claim's verdict, in the claims' order (pending ones included)."""
        exp = ([self.exponential.slower, self.exponential.unchanged] if self.exponential
               else [_pending(*CLAIM_2_SLOWER), _pending(*CLAIM_2_UNCHANGED)])
        return [self.lower_loss.verdict, *exp, self.stepsize.verdict if self.stepsize else _pending(*CLAIM_3),
                self.interior.verdict, *(t.verdict for t in self.toys)]


def check_claims(cfg: StudyConfig, res: Results, sweeps: list[Sweep], tau_max: float,
                 toys: ToyResults) -> ClaimsCheck:
    """Every claim checked against the study's summaries, curves, sweeps and toys."""
    both = all(s in cfg.settings for s in SETTINGS)
    any_rescaled = any(res.has(s, "rescaled") for s in cfg.settings)
    return ClaimsCheck(
        lower_loss=lower_loss(cfg.settings, res),
        exponential=exponential_times(cfg.methods, res, toys) if both else None,
        stepsize=cumulative_stepsize(cfg.settings, res, tau_max) if any_rescaled else None,
        interior=interior_choice(sweeps),
        toys=toy_claims(toys),
    )
