"""Which rank owns (orthogonalizes, keeps the momentum of) each sharded Muon parameter.

Newton-Schulz must see the whole matrix, so every parameter gets one owner
rank inside its shard group. The plan is a pure function of the parameters'
global shapes and dtypes in optimizer order, so every rank computes the same
plan without talking; a fingerprint exchanged once at wrap time proves it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import torch

__all__ = ["OwnerPlan", "plan_owners", "state_bytes"]


@dataclasses.dataclass(frozen=True)
class OwnerPlan:
    """Owner (shard-group rank) per parameter, the per-rank load, and a digest of the inputs."""

    owners: tuple[int, ...]
    loads: tuple[int, ...]
    fingerprint: str

    def owned_by(self, rank: int) -> list[int]:
        """Indices of the parameters ``rank`` owns."""
        return [index for index, owner in enumerate(self.owners) if owner == rank]


def state_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a full-size momentum buffer for a parameter of ``shape`` and ``dtype``."""
    return torch.Size(shape).numel() * dtype.itemsize


def _orthogonalization_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz work grows as rows · cols · min(rows, cols)."""
    rows, cols = shape[0], shape[1]
    return rows * cols * min(rows, cols)


def plan_owners(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], group_size: int) -> OwnerPlan:
    """Assign each parameter to the least-loaded rank, largest orthogonalization first (ties: lowest index)."""
    if group_size < 1:
        raise ValueError(f"Invalid shard group size: {group_size}")
    costs = [_orthogonalization_cost(shape) for shape in shapes]
    loads = [0] * group_size
    owners = [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
        owner = min(range(group_size), key=lambda rank: (loads[rank], rank))
        owners[index] = owner
        loads[owner] += costs[index]
    digest = hashlib.sha256(repr((group_size, [tuple(s) for s in shapes], [str(d) for d in dtypes])).encode())
    return OwnerPlan(tuple(owners), tuple(loads), digest.hexdigest()[:16])
