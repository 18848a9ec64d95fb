"""Asynchronous strategies: subclasses of Flower's ``Strategy`` driven by ``start``."""

from .base import ASGD, AsyncStrategy
from .delay_adaptive import DelayAdaptiveASGD
from .rescaled import RescaledASGD
from .vanilla import VanillaASGD

#: Command-line name → strategy class.
STRATEGIES = {
    "rescaled": RescaledASGD,
    "vanilla": VanillaASGD,
    "delay-adaptive": DelayAdaptiveASGD,
}

__all__ = ["ASGD", "AsyncStrategy", "DelayAdaptiveASGD", "RescaledASGD", "STRATEGIES", "VanillaASGD"]
