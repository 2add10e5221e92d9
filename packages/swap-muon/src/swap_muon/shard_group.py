"""The process group a distributed Muon parameter's rows are sharded over, and this rank's place in it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from swap_core.errors import UnsupportedOptimizerError

__all__ = ["ShardGroup", "shard_group_of"]


@dataclasses.dataclass(frozen=True)
class ShardGroup:
    """The process group a parameter's rows are sharded over, and this rank's place in it."""

    group: dist.ProcessGroup
    size: int
    rank: int

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)


def shard_group_of(params: Sequence[torch.Tensor]) -> ShardGroup:
    """The common shard group of ``params``: ``(Shard(0),)`` on a 1-D mesh or ``(Replicate(), Shard(0))``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = None
    for index, param in enumerate(params):
        if not isinstance(param, DTensor):
            raise UnsupportedOptimizerError(
                f"Distributed Muon needs every parameter to be a DTensor; parameter {index} "
                f"{tuple(param.shape)} is a plain tensor"
            )
        placements = tuple(param.placements)
        supported = placements == (Shard(0),) or placements == (Replicate(), Shard(0))
        if not supported or param.dim() != 2:
            raise UnsupportedOptimizerError(
                f"Parameter {index} {tuple(param.shape)} has placements {placements}; distributed Muon supports "
                "2-D parameters placed (Shard(0),) on a 1-D mesh (FSDP2) or (Replicate(), Shard(0)) (HSDP)"
            )
        if mesh is None:
            mesh = param.device_mesh
        elif param.device_mesh != mesh:
            raise UnsupportedOptimizerError(f"Parameter {index} lives on another device mesh than parameter 0")
    assert mesh is not None
    group = mesh.get_group(mesh.ndim - 1)
    return ShardGroup(group, dist.get_world_size(group), dist.get_rank(group))
