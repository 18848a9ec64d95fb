"""The asynchronous client manager (``AsyncClientManager``) and its parts; see ``manager.py``."""

from .books import Books, is_lost, outcome_of
from .jobs import NODE_GONE, Completion, Job, zero_nonfinite_replicas
from .manager import AsyncClientManager
from .saved import ManagerState
from .membership import Membership, Roster
from .observers import ManagerObserver, OnEvent
from .selection import SELECTORS, IdleSelector, RoundRobin, SameWorker, Selector, UniformIdle
from .settings import ManagerSettings
from .transport import Transport
from .virtual import VirtualSource
from .wall import WallSource, reported_compute_time

__all__ = [
    "NODE_GONE",
    "SELECTORS",
    "AsyncClientManager",
    "Books",
    "IdleSelector",
    "Completion",
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
    "WallSource",
    "is_lost",
    "outcome_of",
    "reported_compute_time",
    "zero_nonfinite_replicas",
]
