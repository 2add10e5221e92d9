"""The batches one step walks, derived from the slots and cached until they change."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..backends.protocol import DeviceBackend
from ..errors import SwapStateError
from ..master_weights import is_fresh
from .dtensor import wrap_local
from .packed import PackedHost, StagingArenas, arena_bytes
from .partition import partition_consecutive
from .slots import SwapSlot
from .store import StateStore

__all__ = ["PlannedBatch", "SwapPlan", "build_plan"]


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
    """``(host, device)`` pairs copied in and out: one per dtype (packed) or one per slot."""
    device_views: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Each slot's local device tensor during the update (a staging-arena view when packed)."""
    segments: list[tuple[int, list[torch.Tensor], list[dict[str, Any] | None], int]] = dataclasses.field(
        default_factory=list
    )
    """``params`` split by param group, bound once per plan: ``(group index, params, optimizer.state[p] of each,
    index of the first one among all parameters in order)`` (``None`` for a parameter without state yet)."""
    slot_states: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The state dict each slot belongs to, aligned with ``slots`` (saves hashing tensors per step)."""
    update_views: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """The same device tensors as the update sees them in ``state`` (DTensors re-wrapped)."""

    @property
    def arena_index(self) -> int:
        return self.index % 2


@dataclasses.dataclass(eq=False)
class SwapPlan:
    batches: list[PlannedBatch]
    arenas: StagingArenas | None
    version: int
    param_count: int = 0
    """Parameters the batches cover, every one once."""
    all_states_exist: bool = False
    """Whether every parameter had its state when the plan was bound (a step may then skip per-parameter checks)."""

    @property
    def peak_staging_bytes(self) -> int:
        """Device bytes of swapped state held at once during a step."""
        if self.arenas is not None:
            return self.arenas.total_bytes
        sizes = [batch.nbytes for batch in self.batches]
        return max((a + b for a, b in itertools.pairwise(sizes)), default=sum(sizes))


def build_plan(
    store: StateStore,
    backend: DeviceBackend,
    params: Sequence[tuple[int, torch.Tensor]],
    *,
    num_batches: int,
    max_batch_bytes: int | None,
    costs: Sequence[int] | None,
    state: Mapping[torch.Tensor, dict[str, Any]],
) -> SwapPlan:
    """Partition ``params`` into batches, lay out their staging views (packed mode) and bind them to ``state``.

    ``state`` is the optimizer's state mapping: each batch keeps the state dict of each of its parameters
    (``None`` for one without state yet), so that a step looks nothing up by tensor.
    """
    slots_of = [list(store.slots.get(param, {}).values()) for _, param in params]
    nbytes = [sum(slot.nbytes for slot in slots) for slots in slots_of]
    if costs is None:
        costs = nbytes
        if sum(nbytes) == 0:
            num_batches = 1  # nothing moves: one batch, no copies
    elif len(costs) != len(params):
        raise ValueError(f"Adapter returned {len(costs)} partition costs for {len(params)} parameters")
    # Adapter costs are rank-independent: every rank must walk the same batches even when it swaps nothing.
    ranges = partition_consecutive(costs, num_batches=num_batches, max_batch_cost=max_batch_bytes)
    batches = [
        PlannedBatch(
            index=index,
            params=list(params[span.start : span.stop]),
            slots=[slot for slots in slots_of[span.start : span.stop] for slot in slots],
            nbytes=sum(nbytes[span.start : span.stop]),
        )
        for index, span in enumerate(ranges)
    ]
    arenas = None
    if store.packed_host is not None and sum(nbytes) > 0:
        arenas = _stage(store.packed_host, backend, batches)
    else:
        for batch in batches:
            batch.device_views = [_device_tensor(slot) for slot in batch.slots]
            batch.transfers = [
                (slot.host_mirror, view) for slot, view in zip(batch.slots, batch.device_views, strict=True)
            ]
    for batch in batches:
        pairs = zip(batch.slots, batch.device_views, strict=True)
        batch.update_views = [wrap_local(view, slot.layout) for slot, view in pairs]
    assert sum(len(batch.params) for batch in batches) == len(params), "the batches cover every parameter once"
    all_states_exist = _bind_states(batches, state)
    return SwapPlan(
        batches=batches,
        arenas=arenas,
        version=store.version,
        param_count=len(params),
        all_states_exist=all_states_exist,
    )


def _is_fresh(state: dict[str, Any] | None) -> bool:
    return state is None or is_fresh(state)


def _bind_states(batches: list[PlannedBatch], state: Mapping[torch.Tensor, dict[str, Any]]) -> bool:
    """Fill each batch's ``segments`` and ``slot_states``; returns whether every parameter has a state."""
    start = 0  # batches are consecutive runs of the parameters in order
    every_state = True
    for batch in batches:
        batch.segments = []
        for group_index, grouped in itertools.groupby(batch.params, key=lambda entry: entry[0]):
            members = [param for _, param in grouped]
            # .get: binding must not create entries (torch keeps no state for never-updated params).
            states = [state.get(param) for param in members]
            every_state = every_state and not any(map(_is_fresh, states))
            batch.segments.append((group_index, members, states, start))
            start += len(members)
        batch.slot_states = [state[slot.param] for slot in batch.slots]
    return every_state


def _stage(packed: PackedHost, backend: DeviceBackend, batches: list[PlannedBatch]) -> StagingArenas:
    ranges = [packed.ranges(batch.slots) for batch in batches]
    region_bytes = [
        {dtype: (stop - start) * dtype.itemsize for dtype, (start, stop) in batch_ranges.items()}
        for batch_ranges in ranges
    ]
    largest = max(arena_bytes(sizes) for sizes in region_bytes)
    arenas = StagingArenas(backend, largest, count=min(2, len(batches)))
    for batch, batch_ranges, sizes in zip(batches, ranges, region_bytes, strict=True):
        regions = arenas.regions(batch.arena_index, sizes)
        batch.transfers = [
            (packed.buffers[dtype][start:stop], regions[dtype]) for dtype, (start, stop) in batch_ranges.items()
        ]
        for slot in batch.slots:
            start = packed.offsets[slot] - batch_ranges[slot.dtype][0]
            batch.device_views.append(slot.shaped(regions[slot.dtype][start : start + slot.numel]))
    arenas.release()
    return arenas


def _device_tensor(slot: SwapSlot) -> torch.Tensor:
    if slot.device is None:
        raise SwapStateError(f"{slot!r} has no device tensor")
    return slot.device
