"""The quadratic toy: F_i(x) = a_i · ‖x − b_i‖² (every coordinate), optional Gaussian gradient noise.

The minimiser of Σ w_i F_i is x* = Σ w_i a_i b_i / Σ w_i a_i, so fixed points can be checked exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class QuadraticTask:
    """The quadratic toy: client i's loss is a_i · ‖x − b_i‖², with optional gradient noise."""

    name = "quadratic"

    def __init__(
        self,
        a: Sequence[float],
        b: Sequence[float],
        dim: int = 1,
        noise: float = 0.0,
        weights: Sequence[float] | None = None,
    ) -> None:
        if len(a) != len(b) or not a:
            raise ValueError("quad-a and quad-b need one value per worker")
        if any(x <= 0 for x in a):
            raise ValueError("quad-a values must be positive")
        if noise < 0:
            raise ValueError("noise must be non-negative")
        self.a = np.asarray(a, dtype=np.float64)
        self.b = np.asarray(b, dtype=np.float64)
        self.dim = int(dim)
        self.noise = float(noise)
        n = len(a)
        self.weights = np.full(n, 1.0 / n) if weights is None else np.asarray(weights, np.float64)
        self.minimizer = float(np.sum(self.weights * self.a * self.b) / np.sum(self.weights * self.a))

    @property
    def needs_rng(self) -> bool:
        """Only noisy gradients draw random numbers (a job's generator is not built otherwise)."""
        return self.noise > 0

    @property
    def num_workers(self) -> int:
        return len(self.a)

    @property
    def size(self) -> int:
        return self.dim

    def initial_params(self, seed: int = 0, x0: float = 0.0) -> np.ndarray:
        del seed
        return np.full(self.dim, float(x0), dtype=np.float64)

    def local_loss(self, x: np.ndarray, worker: int) -> float:
        return float(self.a[worker] * np.sum((x - self.b[worker]) ** 2))

    def gradient(self, x: np.ndarray, worker: int, rng: np.random.Generator, batch_size: int = 0):
        del batch_size
        g = 2.0 * self.a[worker] * (np.asarray(x, np.float64) - self.b[worker])
        if self.noise > 0:
            g = g + self.noise * rng.standard_normal(self.dim)
        return g, self.local_loss(x, worker)

    def fixed_point(self, gammas: Sequence[float]) -> float:
        """Where a method whose aggregate per-cycle stepsizes are Γ_i converges (small α)."""
        g = np.asarray(gammas, np.float64)
        return float(np.sum(g * self.a * self.b) / np.sum(g * self.a))

    def client_losses(self, x: np.ndarray) -> np.ndarray:
        """Every client's loss at ``x``: a_i · ‖x − b_i‖² = a_i · (‖x‖² − 2 b_i Σ x + d b_i²)."""
        x = np.asarray(x, np.float64)
        if self.num_workers <= 1000:  # (each exactly as local_loss computes it)
            return np.array([self.local_loss(x, i) for i in range(self.num_workers)])
        return self.a * (float(x @ x) - 2.0 * self.b * float(x.sum()) + self.dim * self.b**2)

    def evaluate(self, x: np.ndarray) -> dict[str, Any]:
        x = np.asarray(x, np.float64)
        locs = self.client_losses(x)
        loss = float(np.dot(self.weights, locs))
        best = float(np.dot(self.weights, self.client_losses(np.full(self.dim, self.minimizer))))
        out: dict[str, Any] = {"loss": loss, "loss_gap": loss - best, "dist": float(np.linalg.norm(x - self.minimizer)),
                               "worst_client_loss": float(locs.max())}
        if self.num_workers <= 1000:
            out["client_losses"] = locs.tolist()
        return out
