"""Run an experiment on Flower's Simulation Engine (Ray) instead of the in-process Grid.

``run_on_flower(spec)`` starts ``flwr.simulation.run_simulation`` with one virtual SuperNode per
client and a ServerApp whose ``main`` calls ``fl_rescaled.experiment.run(spec, grid=grid)`` on the
Grid Flower hands it. The ClientApp is the project's own (``clients.client_app.app``); each
SuperNode gets ``partition-id``/``num-partitions`` in its node config, so node *i* is worker *i*.

On the virtual clock the manager hands completions over in simulated-time order and each job's
randomness depends only on (seed, partition id, job number), so the run follows the same
trajectory as on the in-process Grid (``tests/test_flower_engine.py`` checks this). Only the
wall time differs: the engine polls for new messages every 0.1 s, one message per node per poll.

``run_many_on_flower(specs)`` runs several experiments one after the other inside one simulation
(one Ray start), with as many SuperNodes as the largest of them needs. ``simulate(main, ...)`` is
the general form: any ``main(grid, context)`` as the ServerApp, any ClientApp (the benchmarks use it),
and ``run_on_flower_engine(server_app, client_app, ...)`` runs a user's app pair, as
``fl_rescaled.run_inprocess`` does on the in-process Grid. Both pass ``run_config`` to the ServerApp's
and every ClientApp's ``Context`` (Flower's ``run_simulation`` leaves them empty).

All of these take ``ray_address`` (default: the ``RAY_ADDRESS`` environment variable) to run the
ClientApp actors on a running, possibly multi-node, Ray cluster instead (``docs/ray_cluster.md``).

Environment: importing ``fl_rescaled`` (before ``flwr``) applies ``fl_rescaled.OFFLINE_ENV``: Flower's
telemetry and update check and Ray's usage statistics off unless the user set them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result
from flwr.supercore.run import Run as FlowerRun

from .clients.client_app import app as project_client_app
from .experiment import RunSpec, resolve, run
from .inprocess import app_run_config
from .reporting import captured_results

log = logging.getLogger("flwr.fl_rescaled")
T = TypeVar("T")

_QUIET_LOGGERS = ("flwr", "ray", "filelock")


class FlowerRunError(RuntimeError):
    """The ServerApp (or the Simulation Engine under it) failed; ``__cause__`` holds the error."""

    outcomes: list[dict[str, Any]] = []  # runs of ``run_many_on_flower`` that finished before


class SimulationAborted(RuntimeError):
    """Raised inside the ServerApp thread once ``run_simulation`` has returned or failed."""


class _AbortableGrid(Grid):
    """Delegates to Flower's Grid; raises once ``abort`` is set.

    If the engine dies (Ray fails to start, say) ``run_simulation`` raises while the ServerApp
    thread may still be waiting for replies that will never come (up to the job TTL). Setting
    ``abort`` makes its next Grid call raise, so the thread ends at once.
    """

    def __init__(self, inner: Grid, abort: threading.Event) -> None:
        self._inner = inner
        self._abort = abort

    def _check(self) -> None:
        if self._abort.is_set():
            raise SimulationAborted("Flower's Simulation Engine has stopped")

    def set_run(self, run: FlowerRun) -> None:  # pragma: no cover - Flower sets the run before main
        self._inner.set_run(run)

    @property
    def run(self) -> FlowerRun:
        return self._inner.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        self._check()
        return self._inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        self._check()
        return self._inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self._check()
        return self._inner.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        self._check()
        return self._inner.send_and_receive(messages, timeout=timeout)


def backend_config(num_cpus: int = 2, *, verbose: bool = False, address: str | None = None) -> dict[str, Any]:
    """The Ray backend settings: ``num_cpus`` for Ray in all, one CPU per ClientApp actor.

    Our manager waits for one job at a time (virtual clock), so more actors would not make a run
    faster; each actor process loads the task's data once (MNIST: ~200 MB each).

    ``address`` is a running Ray cluster to join (``"host:port"``, ``"auto"``, ``"ray://host:port"``;
    ``docs/ray_cluster.md``); ``None`` takes the ``RAY_ADDRESS`` environment variable, and without
    it Ray starts a fresh local instance (``"local"``: never an earlier ``ray start``'s cluster).
    A joined cluster's nodes declare their own CPUs, so ``num_cpus`` is left out (Ray refuses it).
    """
    if num_cpus < 1:
        raise ValueError("num_cpus must be at least 1")
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    resources = {"num_cpus": int(num_cpus), "num_gpus": 0} if address == "local" else {}
    return {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {
            "address": address,
            **resources,
            "include_dashboard": False,
            "logging_level": logging.INFO if verbose else logging.ERROR,
            "log_to_driver": bool(verbose),
        },
    }


class _RunConfigClientApp(ClientApp):
    """A ClientApp that hands ``inner`` a Context whose ``run_config`` is the run's (``run_simulation``
    gives the nodes an empty one)."""

    def __init__(self, inner: ClientApp, run_config: dict[str, Any]) -> None:
        super().__init__()
        self.inner = inner
        self.run_config = dict(run_config)

    def __call__(self, message: Message, context: Context) -> Message:
        return self.inner(message, with_run_config(context, self.run_config))


def with_run_config(context: Context, run_config: dict[str, Any]) -> Context:
    """``context`` with ``run_config`` (Flower forbids changing a Context's run config in place);
    the node's ``state`` is the same object, so what the app stores there persists."""
    return Context(run_id=context.run_id, node_id=context.node_id, node_config=context.node_config,
                   state=context.state, run_config={**run_config})


def simulate(
    main: Callable[[Grid, Context], T],
    *,
    num_supernodes: int,
    client_app: ClientApp | None = None,
    run_config: dict[str, Any] | None = None,
    num_cpus: int = 2,
    verbose: bool = False,
    ray_address: str | None = None,
) -> T:
    """Run ``main(grid, context)`` as the ServerApp of a Flower simulation; return what it returns.

    ``run_simulation`` runs the ServerApp in a thread of this process, so ``main`` can hand back
    any Python object. ``client_app`` defaults to the project's ClientApp; ``run_config`` is the
    run config of the ServerApp's and every node's Context; ``ray_address``: a running Ray cluster
    to run the ClientApps on (``backend_config``'s ``address``). Raises ``FlowerRunError``
    (``__cause__``: the original exception) if ``main`` or the engine failed.
    """
    if num_supernodes < 1:
        raise ValueError("num_supernodes must be at least 1")
    from flwr.simulation import run_simulation  # (Ray, loaded only when a simulation runs)

    if client_app is None:
        client_app = project_client_app
    config = dict(run_config or {})
    if config:
        client_app = _RunConfigClientApp(client_app, config)

    results: list[T] = []
    failure: list[BaseException] = []
    abort = threading.Event()
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        try:
            results.append(main(_AbortableGrid(grid, abort), with_run_config(context, config)))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(exc)
            raise

    saved_levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    if not verbose:
        for name in _QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            if not verbose:  # ray.init's FutureWarning about GPU env vars (we use no GPU)
                warnings.filterwarnings("ignore", category=FutureWarning, module=r"ray\.")
            run_simulation(
                server_app=server_app,
                client_app=client_app,
                num_supernodes=num_supernodes,
                backend_config=backend_config(num_cpus, verbose=verbose, address=ray_address),
                verbose_logging=verbose,
            )
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        cause = failure[0] if failure else exc
        raise FlowerRunError(f"the Flower simulation failed: {type(cause).__name__}: {cause}") from cause
    finally:
        abort.set()  # a ServerApp thread still waiting for replies stops at its next Grid call
        if not verbose:
            for name, level in saved_levels.items():
                logging.getLogger(name).setLevel(level)
    if failure:  # run_simulation re-raises the ServerApp's exception; this is a second guard
        raise FlowerRunError(f"the ServerApp failed: {type(failure[0]).__name__}: {failure[0]}") from failure[0]
    if not results:
        raise FlowerRunError("the ServerApp ended without a result (did the simulation start?)")
    return results[0]


def run_on_flower_engine(server_app: ServerApp, client_app: ClientApp, num_supernodes: int, *,
                         run_config: dict[str, Any] | None = None, app_dir: str | None = None,
                         num_cpus: int = 2, verbose: bool = False, ray_address: str | None = None) -> Result | None:
    """Run a user's ServerApp / ClientApp pair on Flower's Simulation Engine with ``run_config``
    (with ``app_dir``: overrides of the app's ``[tool.flwr.app.config]``); returns, as
    ``fl_rescaled.run_inprocess`` does, the ``Result`` of the last asynchronous strategy the ServerApp
    ran (None if none). ``ray_address``: as ``simulate``'s."""
    config = app_run_config(app_dir, run_config) if app_dir is not None else dict(run_config or {})

    def main(grid: Grid, context: Context) -> Result | None:
        with captured_results() as results:
            server_app(grid, context)
        return results[-1] if results else None

    return simulate(main, num_supernodes=num_supernodes, client_app=client_app, run_config=config,
                    num_cpus=num_cpus, verbose=verbose, ray_address=ray_address)


def run_many_on_flower(specs: Sequence[RunSpec], *, num_cpus: int = 2, verbose: bool = False,
                       ray_address: str | None = None) -> list[dict[str, Any]]:
    """Run ``specs`` one after the other in one Flower simulation; return their outcomes.

    The simulation has ``max(num_clients)`` SuperNodes; a run with fewer clients uses the nodes
    with partition ids 0..n-1. Each outcome has the keys of ``experiment.run``'s plus
    ``"engine": "flower"`` and ``"simulation_seconds"`` (the whole simulation, Ray start-up
    included). ``ray_address``: as ``simulate``'s. Raises ``FlowerRunError`` if a run or the
    engine failed; its ``outcomes`` attribute holds the runs that finished before.
    """
    resolved = [resolve(s) for s in specs]  # validation errors surface before Ray starts
    if not resolved:
        return []
    outcomes: list[dict[str, Any]] = []

    def main(grid: Grid, context: Context) -> list[dict[str, Any]]:
        del context
        for spec in resolved:
            outcome = run(spec, grid=grid)
            outcome["engine"] = "flower"
            outcomes.append(outcome)
        return outcomes

    t0 = time.perf_counter()
    try:
        simulate(main, num_supernodes=max(int(s.num_clients or 1) for s in resolved), num_cpus=num_cpus,
                 verbose=verbose, ray_address=ray_address)
    except FlowerRunError as err:
        err.outcomes = list(outcomes)
        if len(resolved) > 1:
            err.args = (f"{err.args[0]} (after {len(outcomes)} of {len(resolved)} runs)",)
        raise
    total = time.perf_counter() - t0
    for outcome in outcomes:
        outcome["simulation_seconds"] = total
        errors = {k: v for k, v in outcome["rejected"].items() if str(k).startswith("error-code")}
        if errors:
            log.warning("the ClientApps returned error replies on Flower's engine: %s", errors)
    return outcomes


def run_on_flower(spec: RunSpec, *, num_cpus: int = 2, verbose: bool = False,
                  ray_address: str | None = None) -> dict[str, Any]:
    """Run ``spec`` on Flower's Simulation Engine with one SuperNode per client.

    Returns the outcome of ``experiment.run`` (same keys) plus ``"engine": "flower"`` and
    ``"simulation_seconds"`` (wall time of the whole simulation, Ray start-up included). Ray gets
    ``num_cpus`` CPUs (``ray_address``: a running Ray cluster instead, as ``simulate``'s); Flower's
    and Ray's logs are silenced unless ``verbose``. Raises
    ``FlowerRunError`` if the ServerApp or the engine failed, ``ValueError`` for an invalid spec.
    """
    return run_many_on_flower([spec], num_cpus=num_cpus, verbose=verbose, ray_address=ray_address)[0]
