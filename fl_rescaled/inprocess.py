"""Run any ServerApp / ClientApp pair on the in-process Grid, as ``flwr.simulation.run_simulation`` would.

The ServerApp gets a real ``Context`` (its ``run_config``), every node gets its own ``Context`` with
``partition-id``/``num-partitions`` (plus any ``node_configs`` keys, ``tau`` for the virtual clock)
and the same ``run_config``. Nothing is polled: a job runs when its reply is pulled, so on the virtual
clock a run goes as fast as its computation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.config import get_fused_config_from_dir
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import Result, Strategy

from .grid import InProcessGrid
from .reporting import captured_results, report_result

#: Flower's own ``Strategy.start`` (FedAvg's and every Flower strategy's round loop).
_FLOWER_START = Strategy.start
_HOOKED = threading.Lock()
_RUNS = [0]  # run_inprocess calls under way (the hook is in place while there are any)


def _start_reported(self: Strategy, *args: Any, **kwargs: Any) -> Result:
    """Flower's ``Strategy.start``, its ``Result`` handed to the ``captured_results`` block of this
    thread (if any) as the asynchronous strategies hand theirs."""
    result = _FLOWER_START(self, *args, **kwargs)
    report_result(result)
    return result


@contextmanager
def _flower_results() -> Iterator[None]:
    """While a ``run_inprocess`` call runs, Flower's strategies report their ``Result`` too (their
    ``start`` returns it to the ServerApp only, whose ``main`` returns nothing): ``Strategy.start``
    is wrapped, then put back when the last such call ends. The wrapper only passes the result on."""
    with _HOOKED:
        if _RUNS[0] == 0 and Strategy.start is _FLOWER_START:
            Strategy.start = _start_reported  # type: ignore[method-assign]
        _RUNS[0] += 1
    try:
        yield
    finally:
        with _HOOKED:
            _RUNS[0] -= 1
            if _RUNS[0] == 0 and Strategy.start is _start_reported:
                Strategy.start = _FLOWER_START  # type: ignore[method-assign]


def app_run_config(app_dir: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """An app's ``[tool.flwr.app.config]`` with ``overrides`` applied, as ``flwr run`` fuses them
    (an unknown key is an error there too)."""
    return dict(get_fused_config_from_dir(Path(app_dir), dict(overrides or {})))


def run_inprocess(
    server_app: ServerApp,
    client_app: ClientApp,
    num_supernodes: int,
    *,
    run_config: dict[str, Any] | None = None,
    node_configs: list[dict[str, Any]] | None = None,
    app_dir: str | Path | None = None,
    seed: int = 0,
    threaded: bool = False,
    workers: int = 1,
    ahead: bool = True,
    batch: bool = True,
) -> Result | None:
    """Run ``server_app`` against ``num_supernodes`` nodes of ``client_app`` in this process.

    Parameters
    ----------
    server_app, client_app : ServerApp, ClientApp
        The app's two halves, as given to ``run_simulation``.
    num_supernodes : int
        Number of nodes; node i has ``partition-id`` i.
    run_config : dict, optional
        The run config both sides see (``context.run_config``). With ``app_dir`` these are
        overrides of the app's ``[tool.flwr.app.config]``.
    node_configs : list of dict, optional
        Extra node-config keys per node (e.g. ``{"tau": 4.0}``: the node's compute time on the
        virtual clock).
    app_dir : path, optional
        The app's folder (its ``pyproject.toml``), to start from its run-config defaults.
    seed : int (default: 0)
        Seeds the node ids.
    threaded : bool (default: False)
        Run each node on its own thread (the wall clock) instead of on demand (the virtual clock).
    workers : int (default: 1)
        Virtual clock: threads that compute the jobs in flight as soon as they are sent, and the
        strategy's central evaluations, while its loop goes on (``InProcessGrid``). The run's
        trajectory is the same for any value; ClientApps whose work releases the GIL (torch
        training loops) run in parallel.
    ahead : bool (default: True)
        With ``workers`` ≥ 2: compute the jobs on the pool as soon as they are sent (False: only the
        evaluations run there). Off when the jobs are batched.
    batch : bool (default: True)
        When ``client_app`` offers a batch entry (``fl_rescaled.batching.BatchedClientApp``, such as
        ``fl_rescaled.torch_batch.torch_client_app`` builds): compute the jobs in flight lazily, in
        batches (``fl_rescaled.grid_batch``). Other ClientApps run one job at a time either way.

    Returns
    -------
    Result or None
        The ``Result`` of the last strategy the ServerApp ran (``strategy.start``), as that call
        returned it: an ``AsyncResult`` for the asynchronous strategies, Flower's ``Result`` for
        Flower's own (FedAvg, ...); None if it ran none. An exception of the ServerApp (a
        strategy's ``RunFailed``, say) propagates.
    """
    config = app_run_config(app_dir, run_config) if app_dir is not None else dict(run_config or {})
    if node_configs is not None and len(node_configs) != num_supernodes:
        raise ValueError(f"node_configs has {len(node_configs)} entries for {num_supernodes} nodes")
    grid = InProcessGrid(client_app, num_supernodes, run_config=config, node_configs=node_configs, seed=seed,
                         threaded=threaded, workers=workers, ahead=ahead, batch=batch)
    context = Context(run_id=grid.run.run_id, node_id=SUPERLINK_NODE_ID, node_config={}, state=RecordDict(),
                      run_config=dict(config))
    try:
        with captured_results() as results, _flower_results():
            server_app(grid, context)
    finally:
        grid.close()
    return results[-1] if results else None
