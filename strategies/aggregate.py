"""Aggregates the round-based methods share."""

from __future__ import annotations

import numpy as np


def average_of_means(G: np.ndarray, counts: np.ndarray, n: int) -> np.ndarray:
    """(1/n) Σ_l G_l / b_l over the rows with b_l > 0, in float64.

    Accumulated row by row: the same bits as ``(G[mask] / b[mask, None]).sum(axis=0) / n`` (numpy
    reduces axis 0 in row order) without its rows × d float64 temporary, which made this the
    slowest step of Malenia and Ringleader on MNIST (27 ms vs 6 ms per call with 5 replicas).
    """
    acc = np.zeros(G.shape[1])
    for row in np.flatnonzero(counts):
        acc += G[row] / counts[row]
    return acc / n
