"""Expert parallelism: the dispatcher and collective helpers."""

from .collectives import all_to_all
from .dispatcher import DispatchHandle, ExpertParallelDispatcher, PendingExchange

__all__ = ["DispatchHandle", "ExpertParallelDispatcher", "PendingExchange", "all_to_all"]
