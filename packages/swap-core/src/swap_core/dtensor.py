"""DTensor (FSDP2) states: swap their local shards, show the update DTensors again.

Bytes only ever move for the local shard (``to_local()``); the sharding layout
is remembered per slot so that the update and ``state`` see DTensors exactly
like the wrapped optimizer would have created them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

__all__ = ["ShardLayout", "local_tensor", "shard_layout", "wrap_local"]


@functools.cache
def _dtensor_type() -> type[torch.Tensor] | None:
    """DTensor's class, imported once (this runs for every gradient of every step)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How a local shard maps onto its global DTensor."""

    device_mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]


def shard_layout(tensor: torch.Tensor) -> ShardLayout | None:
    """The DTensor layout of ``tensor``, or ``None`` for a plain tensor."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(tensor, dtensor):
        return None
    return ShardLayout(tensor.device_mesh, tuple(tensor.placements), tensor.shape, tuple(tensor.stride()))  # type: ignore[attr-defined]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, the tensor itself otherwise."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        local: torch.Tensor = tensor.to_local()  # type: ignore[attr-defined]
        return local
    return tensor


def wrap_local(local: torch.Tensor, layout: ShardLayout | None) -> torch.Tensor:
    """``local`` as the DTensor described by ``layout`` (no communication, no copy)."""
    if layout is None:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, layout.device_mesh, layout.placements, run_check=False, shape=layout.shape, stride=layout.stride
    )
