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

logging.getLogger("fl_rescaled").setLevel(logging.ERROR)


def quad(**kw):
    """Run a quadratic-task simulation in process and return run()'s outcome dict."""
    from fl_rescaled.experiment import RunSpec, run

    kw.setdefault("task", "quadratic")
    return run(RunSpec(**kw))


@pytest.fixture
def mnist_cache():
    """Path of the real-MNIST cache, or skip the test when it is absent."""
    from fl_rescaled.data import CACHE_FILENAME, default_cache_dir

    path = default_cache_dir() / CACHE_FILENAME
    if not path.exists() and not os.environ.get("FL_RESCALED_REQUIRE_MNIST"):
        pytest.skip(f"no MNIST cache at {path} (run: python -c 'import fl_rescaled.data as d; d.ensure_mnist_cached()')")
    return path
