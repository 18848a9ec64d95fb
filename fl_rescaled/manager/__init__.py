"""The asynchronous client manager (``AsyncClientManager``) and its parts; see ``manager.py``."""

from .books import Books, WorkerBook
from .jobs import NODE_GONE, Completion, Job, zero_nonfinite_replicas
from .manager import AsyncClientManager
from .membership import Membership
from .observers import ManagerObserver
from .restore import attach, lose_inflight, resend_inflight
from .scheduler import VirtualScheduler
from .transport import Transport

__all__ = [
    "NODE_GONE",
    "AsyncClientManager",
    "Books",
    "Completion",
    "Job",
    "ManagerObserver",
    "Membership",
    "Transport",
    "VirtualScheduler",
    "WorkerBook",
    "attach",
    "lose_inflight",
    "resend_inflight",
    "zero_nonfinite_replicas",
]
