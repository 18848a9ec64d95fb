"""fl-rescaled: asynchronous SGD strategies for Flower, starting with Rescaled ASGD.

    from fl_rescaled import RescaledASGD
    result = RescaledASGD(lr=0.1).start(grid=grid, initial_arrays=arrays, time_budget=1000)
"""

from .clock import DEFAULT_TAUS, DelayModel, VirtualClock, WallClock, tau_stats
from .grid import InProcessGrid
from .manager import AsyncClientManager, Completion, Job
from .stepsizes import delay_adaptive_stepsize, rescaled_stepsize, vanilla_stepsize

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
