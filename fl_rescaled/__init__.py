"""fl-rescaled: asynchronous SGD strategies for Flower, starting with Rescaled ASGD.

    from fl_rescaled import RescaledASGD
    result = RescaledASGD(lr=0.1).start(grid=grid, initial_arrays=arrays, time_budget=1000)
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

from .clock import DEFAULT_TAUS, DelayModel, VirtualClock, WallClock, tau_stats  # noqa: E402
from .grid import InProcessGrid  # noqa: E402
from .manager import AsyncClientManager, Completion, Job  # noqa: E402
from .stepsizes import delay_adaptive_stepsize, rescaled_stepsize, vanilla_stepsize  # noqa: E402

# The strategies live in the top-level ``strategies`` package (which imports this one); they are
# re-exported here lazily so either package can be imported first.
_FROM_STRATEGIES = {
    "STRATEGIES", "AsyncStrategy", "ASGD", "ConcurrentASGD", "DelayAdaptiveASGD", "FedAsync", "FedBuff",
    "MaleniaSGD", "MinibatchSGD", "RescaledASGD", "RingleaderASGD", "VanillaASGD",
}


def __getattr__(name: str):
    if name in _FROM_STRATEGIES:
        import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'fl_rescaled' has no attribute {name!r}")

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TAUS",
    "OFFLINE_ENV",
    "STRATEGIES",
    "AsyncClientManager",
    "AsyncStrategy",
    "Completion",
    "ConcurrentASGD",
    "DelayAdaptiveASGD",
    "DelayModel",
    "FedAsync",
    "FedBuff",
    "MaleniaSGD",
    "MinibatchSGD",
    "RingleaderASGD",
    "InProcessGrid",
    "Job",
    "RescaledASGD",
    "VanillaASGD",
    "VirtualClock",
    "WallClock",
    "delay_adaptive_stepsize",
    "rescaled_stepsize",
    "tau_stats",
    "vanilla_stepsize",
]
