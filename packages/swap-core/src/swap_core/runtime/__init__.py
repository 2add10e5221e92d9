"""Mechanism: slots, packed host memory and staging arenas, partitioning, the pipeline.

The modules are swap-core's own. Public here, for adapters and sibling packages that lay out states of
DTensor parameters: :func:`local_tensor`, :func:`shard_layout`, :func:`wrap_local` and
:class:`ShardLayout` (a DTensor's local shard and its layout), and :func:`align_up`; for adapters that
run an optimizer's own code share by share: :class:`NarrowedGroups`, :class:`GroupValues` and
:func:`same_value`.
"""

from .dtensor import ShardLayout, local_tensor, shard_layout, wrap_local
from .group_values import GroupValues, same_value
from .narrowed_groups import NarrowedGroups
from .packed import align_up

__all__ = [
    "GroupValues",
    "NarrowedGroups",
    "ShardLayout",
    "align_up",
    "local_tensor",
    "same_value",
    "shard_layout",
    "wrap_local",
]
