"""Adapters: the per-family policy the swap runtime consults, and the registry that finds them."""

from __future__ import annotations

from swap_core.adapters.base import (
    ADAPTER_API_VERSION,
    AdapterFactory,
    StateInit,
    StateSwapAdapter,
    UpdateBatch,
    refuse_differentiable,
)
from swap_core.adapters.registry import (
    ENTRY_POINT_GROUP,
    STRICT_PLUGINS_ENV,
    AdapterRegistry,
    default_registry,
    register_adapter,
)

__all__ = [
    "ADAPTER_API_VERSION",
    "ENTRY_POINT_GROUP",
    "STRICT_PLUGINS_ENV",
    "AdapterFactory",
    "AdapterRegistry",
    "StateInit",
    "StateSwapAdapter",
    "UpdateBatch",
    "default_registry",
    "refuse_differentiable",
    "register_adapter",
]
