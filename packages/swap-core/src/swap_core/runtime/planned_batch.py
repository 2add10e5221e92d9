"""One batch of a plan: consecutive parameters whose swapped states move and update together."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .slots import SwapSlot

__all__ = ["GradientPositions", "PlannedBatch"]

GradientPositions = slice | list[int]
"""Where a segment's gradients lie among all gradients in parameter order: a slice, or (with gaps) the positions."""


@dataclasses.dataclass(eq=False)
class PlannedBatch:
    """Consecutive parameters whose swapped states move and update together."""

    index: int
    params: list[tuple[int, torch.Tensor]]
    """``(group index, parameter)`` in param-group order."""
    slots: list[SwapSlot]
    nbytes: int
    """Swapped state bytes of the batch (without packing padding)."""
    transfers: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    """``(host, device)`` pairs copied in and out: one per dtype (packed; two where a dtype's region crosses the
    middle of the arena, with more batches than arenas) or one per slot."""
    spare_transfers: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    """The same copies with each state's spare host copy in place of its mirror (where the store keeps spares): a
    walk whose updates are provisional copies out there."""
    front_transfers: int = 0
    """How many of ``transfers`` (the first ones) lie in the first half of the arena (packed, more batches than
    arenas); ``len(transfers)`` otherwise. The copy-in of a batch waits half by half for the copy-out of the batch
    that staged in the same arena before it."""
    device_views: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Each slot's local device tensor during the update (a staging-arena view when packed)."""
    segments: list[tuple[int, list[torch.Tensor], list[dict[str, Any] | None], GradientPositions]] = dataclasses.field(
        default_factory=list
    )
    """``params`` split by param group, bound once per plan: ``(group index, params, optimizer.state[p] of each,
    their positions among all parameters in order)`` (``None`` for a parameter without state yet)."""
    slot_states: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The state dict each slot belongs to, aligned with ``slots`` (saves hashing tensors per step)."""
    nested_slots: bool = False
    """Whether a slot's state lives in a dict nested in its entry (its key a path, see
    :mod:`~swap_core.runtime.nested_entries`), found there at each update; else each is a key of its entry."""
    update_views: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """The same device tensors as the update sees them in ``state`` (DTensors re-wrapped)."""
