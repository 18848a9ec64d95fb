"""Asynchronous strategies: subclasses of Flower's ``Strategy`` driven by ``start``.

``STRATEGIES`` is the registry: command-line name → class. The command line, the Flower run config
and the paper study build strategies from it and read each one's options from its constructor.
"""

from fl_rescaled.reporting import AsyncResult
from fl_rescaled.stepsizes import damped_rescaled

from .asgd import ASGD, asgd_variant
from .base import AsyncStrategy
from .concurrent import ConcurrentASGD
from .delay_adaptive import DelayAdaptiveASGD
from .dp import AsyncDPAdaptiveClipping, AsyncDPFixedClipping
from .fedasync import FedAsync
from .fedbuff import FedBuff
from .malenia import MaleniaSGD
from .minibatch import FedAvgSync, MinibatchSGD
from .rescaled import RescaledASGD
from .ringleader import RingleaderASGD
from .vanilla import VanillaASGD

#: Command-line name → strategy class.
STRATEGIES: dict[str, type[AsyncStrategy]] = {
    "rescaled": RescaledASGD,
    "vanilla": VanillaASGD,
    "delay-adaptive": DelayAdaptiveASGD,
    "malenia": MaleniaSGD,
    "ringleader": RingleaderASGD,
    "minibatch": MinibatchSGD,
    "concurrent": ConcurrentASGD,
    "fedasync": FedAsync,
    "fedbuff": FedBuff,
    "fedavg": FedAvgSync,
    "damped-rescaled": asgd_variant("damped-rescaled", damped_rescaled),
}

__all__ = [
    "ASGD",
    "STRATEGIES",
    "AsyncDPAdaptiveClipping",
    "AsyncDPFixedClipping",
    "AsyncResult",
    "AsyncStrategy",
    "ConcurrentASGD",
    "DelayAdaptiveASGD",
    "FedAsync",
    "FedAvgSync",
    "FedBuff",
    "MaleniaSGD",
    "MinibatchSGD",
    "RescaledASGD",
    "RingleaderASGD",
    "VanillaASGD",
    "asgd_variant",
]
