"""Adapters: the per-family policy the swap runtime consults, the registry that finds them, and everything a family
package may use to write one (docs/adapters.md, "The adapter API"):

- the contract: :class:`StateSwapAdapter`, :class:`UpdateBatch`, :class:`StateInit`, :data:`ADAPTER_API_VERSION`,
  :func:`refuse_differentiable`, the registry;
- DTensor parameters: :func:`local_tensor`, :func:`shard_layout`, :func:`wrap_local` and :class:`ShardLayout` (a
  DTensor's local shard and its layout), and :func:`align_up` for byte offsets;
- an optimizer's own code run share by share: :class:`NarrowedGroups`, :class:`GroupValues` and :func:`same_value`.
"""

from __future__ import annotations

from swap_core.adapters.base import (
    ADAPTER_API_VERSION,
    AdapterFactory,
    StateInit,
    StateSwapAdapter,
    UpdateBatch,
    refuse_differentiable,
)
from swap_core.adapters.group_values import GroupValues, same_value
from swap_core.adapters.narrowed_groups import NarrowedGroups
from swap_core.adapters.registry import (
    ENTRY_POINT_GROUP,
    STRICT_PLUGINS_ENV,
    AdapterRegistry,
    default_registry,
    register_adapter,
)
from swap_core.alignment import align_up
from swap_core.dtensor import ShardLayout, local_tensor, shard_layout, wrap_local
from swap_core.runtime.nested_entries import SEPARATOR as STATE_PATH_SEPARATOR

__all__ = [
    "ADAPTER_API_VERSION",
    "ENTRY_POINT_GROUP",
    "STATE_PATH_SEPARATOR",
    "STRICT_PLUGINS_ENV",
    "AdapterFactory",
    "AdapterRegistry",
    "GroupValues",
    "NarrowedGroups",
    "ShardLayout",
    "StateInit",
    "StateSwapAdapter",
    "UpdateBatch",
    "align_up",
    "default_registry",
    "local_tensor",
    "refuse_differentiable",
    "register_adapter",
    "same_value",
    "shard_layout",
    "wrap_local",
]
