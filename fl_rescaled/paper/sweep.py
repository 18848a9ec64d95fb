"""The α sweep of one (setting, method): the grid, its extension past an edge, the choice.

The cycle stepsize α is chosen by the final training loss of seed 0 (``score``: a diverged run
counts as +inf). While the best α sits at an edge of the grid, the grid grows past that edge (×10
below 1, half-decades 1, 3, 10, 30, … from 1 up), at most ``max_extend`` steps per direction; then
the other seeds run at the chosen α.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


def fmt_lr(a: float) -> str:
    return f"{a:g}"


def clean(a: float) -> float:
    """Round away binary noise from ×10 / ×3 steps (0.30000000000000004 → 0.3)."""
    return float(f"{a:.10g}")


def next_up(a: float) -> float:
    """The next α above ``a``: ×10 below 1, half-decades (1, 3, 10, 30, …) from 1 up."""
    if a < 1.0 - 1e-12:
        return clean(a * 10)
    e = math.floor(math.log10(a) + 1e-9)
    m = a / 10**e
    return clean((3.0 if m < 2.0 else 10.0) * 10**e)


def next_down(a: float) -> float:
    return clean(a / 10)


def score(rec: dict[str, Any]) -> float:
    """The selection criterion: the final training loss, +inf for a diverged run."""
    return float(rec["final_loss"]) if not rec.get("diverged") else math.inf


@dataclass(frozen=True)
class RunKey:
    """One MNIST run of the study: its compute-time setting, method, α and seed."""

    setting: str
    method: str
    lr: float
    seed: int

    def stem(self) -> str:
        return f"lr{fmt_lr(self.lr)}_seed{self.seed}"

    def label(self) -> str:
        return f"{self.method} {self.setting} α={fmt_lr(self.lr)} seed={self.seed}"


@dataclass
class Sweep:
    """The α search and the seeds of one (setting, method).

    ``results`` and ``failed`` are keyed by (α, seed); ``needed()`` says which runs come next.
    """

    setting: str
    method: str
    alphas: list[float]
    seeds: int
    max_extend: int
    results: dict[tuple[float, int], dict[str, Any]] = field(default_factory=dict)
    failed: set[tuple[float, int]] = field(default_factory=set)
    ext_up: int = 0
    ext_down: int = 0
    chosen: float | None = None
    note: str = ""

    def planned(self) -> int:
        return len(self.alphas) + self.seeds - 1

    def _done(self, k: tuple[float, int]) -> bool:
        return k in self.results or k in self.failed

    def needed(self) -> list[tuple[float, int]]:
        """Runs needed next (nothing while some of the current sweep is missing)."""
        sweep = [(a, 0) for a in self.alphas]
        missing = [k for k in sweep if not self._done(k)]
        if missing:
            return missing
        if self.chosen is None:
            self._decide()
            if self.chosen is None:
                return self.needed()
        return [(self.chosen, s) for s in range(1, self.seeds) if not self._done((self.chosen, s))]

    def scores(self) -> dict[float, float]:
        return {a: (score(self.results[(a, 0)]) if (a, 0) in self.results else math.inf) for a in self.alphas}

    def _decide(self) -> None:
        sc = self.scores()
        best = min(self.alphas, key=lambda a: (sc[a], a))
        if not math.isfinite(sc[best]):  # everything diverged: go down
            if self.ext_down < self.max_extend:
                self.ext_down += 1
                self.alphas.insert(0, next_down(self.alphas[0]))
                return
            self.chosen, self.note = best, "every α diverged (extension cap reached)"
            return
        if best == self.alphas[-1]:
            if self.ext_up < self.max_extend:
                self.ext_up += 1
                self.alphas.append(next_up(self.alphas[-1]))
                return
            self.chosen, self.note = best, f"top edge (upward extension capped at {self.max_extend})"
            return
        if best == self.alphas[0] and len(self.alphas) > 1:
            if self.ext_down < self.max_extend:
                self.ext_down += 1
                self.alphas.insert(0, next_down(self.alphas[0]))
                return
            self.chosen, self.note = best, f"bottom edge (downward extension capped at {self.max_extend})"
            return
        self.chosen, self.note = best, "interior"

    def choose_provisional(self) -> None:
        """A sweep still waiting for runs (``--report-only``): its best finished α, marked provisional."""
        if self.chosen is None and any(seed == 0 for _, seed in self.results):
            sc = {a: score(r) for (a, seed), r in self.results.items() if seed == 0}
            self.chosen = min(sc, key=lambda a: (sc[a], a))
            self.note = "provisional: the sweep's runs are not all finished"

    def provisional(self) -> bool:
        return self.note.startswith("provisional")

    def seed_records(self) -> list[dict[str, Any]]:
        if self.chosen is None:
            return []
        return [self.results[(self.chosen, s)] for s in range(self.seeds) if (self.chosen, s) in self.results]
