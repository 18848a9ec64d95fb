"""The client manager's settings, declared once (``fl_rescaled.settings``): the command line, the
run config and ``start(..., settings=...)`` all read them from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fl_rescaled.settings import of_dataclass, setting

from .wall import TAU_ESTIMATORS


@dataclass
class ManagerSettings:
    """How the client manager talks to the nodes and estimates their compute times."""

    tau_estimator: str = setting("interval", "wall clock: how each client's τ is estimated: interval (the time "
                                             "between its deliveries) | compute (its reported compute time, "
                                             "clamped to what the server saw)", choices=TAU_ESTIMATORS)
    tau_smoothing: float = setting(0.2, "wall clock: weight of a new measurement in a τ estimate (an "
                                        "exponential moving average)", positive=True, high=1.0)
    poll_interval: float = setting(0.002, "seconds between two polls of Flower's Grid when no reply is ready",
                                   positive=True, high=60.0)
    node_refresh: float = setting(2.0, "wall clock: seconds between two looks for nodes that left or (re)appeared",
                                  positive=True, high=3600.0)
    worker_config: list[dict[str, Any]] | None = setting(None, "extra job config per worker (emulated τ_i)",
                                                         cli=False)

    def __post_init__(self) -> None:
        for s in of_dataclass(ManagerSettings, "manager"):
            s.check(getattr(self, s.name))
