"""swap: optimizer states in pinned host memory, streamed through the accelerator during ``step()``."""

from __future__ import annotations

from .__about__ import __version__
from .adapters.base import ADAPTER_API_VERSION, StateInit, StateSwapAdapter, UpdateBatch
from .adapters.registry import AdapterRegistry, default_registry, register_adapter
from .backends.protocol import DeviceBackend
from .config import SwapConfig
from .optimizer import SwapOptimizer
from .stats import SwapStats
from .wrap import swap_optimizer

__all__ = [
    "ADAPTER_API_VERSION",
    "AdapterRegistry",
    "DeviceBackend",
    "StateInit",
    "StateSwapAdapter",
    "SwapConfig",
    "SwapOptimizer",
    "SwapStats",
    "UpdateBatch",
    "__version__",
    "default_registry",
    "register_adapter",
    "swap_optimizer",
]
