"""Asynchronous strategies: subclasses of Flower's ``Strategy`` driven by ``start``."""

from .base import ASGD, AsyncResult, AsyncStrategy
from .concurrent import ConcurrentASGD
from .delay_adaptive import DelayAdaptiveASGD
from .fedasync import FedAsync
from .fedbuff import FedBuff
from .malenia import MaleniaSGD
from .minibatch import MinibatchSGD
from .rescaled import RescaledASGD
from .ringleader import RingleaderASGD
from .vanilla import VanillaASGD

#: Command-line name → strategy class.
STRATEGIES = {
    "rescaled": RescaledASGD,
    "vanilla": VanillaASGD,
    "delay-adaptive": DelayAdaptiveASGD,
    "malenia": MaleniaSGD,
    "ringleader": RingleaderASGD,
    "minibatch": MinibatchSGD,
    "concurrent": ConcurrentASGD,
    "fedasync": FedAsync,
    "fedbuff": FedBuff,
}

__all__ = [
    "ASGD",
    "AsyncResult",
    "STRATEGIES",
    "AsyncStrategy",
    "ConcurrentASGD",
    "DelayAdaptiveASGD",
    "FedAsync",
    "FedBuff",
    "MaleniaSGD",
    "MinibatchSGD",
    "RescaledASGD",
    "RingleaderASGD",
    "VanillaASGD",
]
