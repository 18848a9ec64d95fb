"""fl-rescaled: asynchronous strategies for Flower, starting with Rescaled ASGD.

A drop-in for Flower's ``FedAvg`` in a ServerApp (the ClientApp does not change)::

    from fl_rescaled import FedBuff
    result = FedBuff().start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                             train_config=ConfigRecord({"lr": 0.01}), num_updates=100)

``RescaledASGD(reply="model")`` gives the same ClientApp time-proportional weights.
"""

import os as _os

#: Offline by default. Unless the user set them, importing fl_rescaled turns off Flower's telemetry
#: and update check and Ray's usage statistics (a user may have no internet). Flower reads its
#: variables when it is first imported, so they are applied here, before any module of this package
#: imports flwr: import fl_rescaled before flwr for them to take effect.
OFFLINE_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}
for _key, _value in OFFLINE_ENV.items():
    _os.environ.setdefault(_key, _value)

# In the source tree the strategies and the ClientApp live in the top-level folders ``strategies/``
# and ``clients/`` (an installed distribution has them inside this package, as
# ``fl_rescaled.strategies`` and ``fl_rescaled.clients``): make them importable under those names.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "strategies")) and _os.path.isfile(
    _os.path.join(_root, "strategies", "__init__.py")
):
    __path__.append(_root)  # noqa: F821 - the package's own search path

from .clock import DEFAULT_TAUS, Clock, DelayModel, VirtualClock, WallClock, tau_stats  # noqa: E402
from .errors import RejectedReply, RunFailed  # noqa: E402
from .grid import InProcessGrid  # noqa: E402
from .layout import ModelLayout  # noqa: E402
from .manager import AsyncClientManager, Completion, Job, ManagerObserver, ManagerSettings, OnEvent  # noqa: E402
from .messages import add_partition_query  # noqa: E402
from .stepsizes import TauTable, delay_adaptive_stepsize, rescaled_stepsize, vanilla_stepsize  # noqa: E402
from .strategies import (  # noqa: E402
    ASGD,
    STRATEGIES,
    AsyncDPAdaptiveClipping,
    AsyncDPFixedClipping,
    AsyncResult,
    AsyncStrategy,
    ConcurrentASGD,
    DelayAdaptiveASGD,
    FedAsync,
    FedBuff,
    MaleniaSGD,
    MinibatchSGD,
    RescaledASGD,
    RingleaderASGD,
    VanillaASGD,
    asgd_variant,
)
from .inprocess import run_inprocess  # noqa: E402
from . import data  # noqa: E402  (fl_rescaled.data.load_mnist without an import of its own; numpy only)

__version__ = "0.1.0"

__all__ = [
    "ASGD",
    "Clock",
    "DEFAULT_TAUS",
    "OFFLINE_ENV",
    "STRATEGIES",
    "AsyncClientManager",
    "AsyncDPAdaptiveClipping",
    "AsyncDPFixedClipping",
    "AsyncResult",
    "AsyncStrategy",
    "Completion",
    "ConcurrentASGD",
    "DelayAdaptiveASGD",
    "DelayModel",
    "FedAsync",
    "FedBuff",
    "InProcessGrid",
    "Job",
    "ManagerObserver",
    "ManagerSettings",
    "MaleniaSGD",
    "MinibatchSGD",
    "ModelLayout",
    "OnEvent",
    "RejectedReply",
    "RescaledASGD",
    "RingleaderASGD",
    "RunFailed",
    "TauTable",
    "VanillaASGD",
    "VirtualClock",
    "WallClock",
    "add_partition_query",
    "asgd_variant",
    "data",
    "delay_adaptive_stepsize",
    "rescaled_stepsize",
    "run_inprocess",
    "tau_stats",
    "vanilla_stepsize",
]
