"""The asynchronous client manager (``AsyncClientManager``) and its parts; see ``manager.py``."""

from fl_rescaled.algorithm import Completion, Job

from .books import Books, is_lost, outcome_of
from .jobs import NODE_GONE, zero_nonfinite_replicas
from .manager import AsyncClientManager
from .membership import Membership, Roster
from .observers import ManagerObserver, OnEvent
from .selection import SELECTORS, IdleSelector, RoundRobin, SameWorker, Selector, UniformIdle
from .settings import ManagerSettings
from .source import CompletionSource
from .state import ManagerState
from .transport import Transport
from .virtual import VirtualSource, VirtualState
from .wall import WallSource, WallState, reported_compute_time

__all__ = [
    "NODE_GONE",
    "SELECTORS",
    "AsyncClientManager",
    "Books",
    "IdleSelector",
    "Completion",
    "CompletionSource",
    "Job",
    "ManagerObserver",
    "ManagerSettings",
    "ManagerState",
    "OnEvent",
    "Membership",
    "Roster",
    "RoundRobin",
    "SameWorker",
    "Selector",
    "Transport",
    "UniformIdle",
    "VirtualSource",
    "VirtualState",
    "WallSource",
    "WallState",
    "is_lost",
    "outcome_of",
    "reported_compute_time",
    "zero_nonfinite_replicas",
]
