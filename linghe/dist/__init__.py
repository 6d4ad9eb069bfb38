"""Expert parallelism: the dispatcher and collective helpers."""

from .collectives import all_to_all
from .dispatcher import DispatchHandle, ExpertParallelDispatcher

__all__ = ["DispatchHandle", "ExpertParallelDispatcher", "all_to_all"]
