"""The batches one step walks, derived from the slots and cached until they change.

A plan walks its swapped batches in ``batches`` order (parameter order, or its reverse: the order in which a
backward finalizes the gradients). Parameters whose states all stay on the device (no swapped slot) form the
plan's ``resident`` batch, updated first, while batch 0 is still being copied in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..adapters.base import RESIDENT_BATCH_INDEX
from ..backends.protocol import DeviceBackend
from ..dtensor import wrap_local
from .partition import partition_consecutive
from .planned_batch import GradientPositions, PlannedBatch
from .slots import SwapSlot
from .staging import Staging, stage_batches, staging_peak_bytes
from .state_keys import is_fresh
from .store import StateStore

__all__ = [
    "RESIDENT_BATCH_INDEX",
    "GradientPositions",
    "Partition",
    "PlannedBatch",
    "SwapPlan",
    "build_plan",
    "staging_bytes",
]


@dataclasses.dataclass(eq=False)
class SwapPlan:
    batches: list[PlannedBatch]
    """The swapped batches in the order a step walks them (``batches[i].index == i``)."""
    staging: Staging
    """Where the batches live on the device during a step (packed arenas, or each state's own storage)."""
    version: int
    param_count: int = 0
    """Parameters the batches (the resident one included) cover, every one once."""
    all_states_exist: bool = False
    """Whether every parameter had its state when the plan was bound (a step may then skip per-parameter checks)."""
    resident: PlannedBatch | None = None
    """Parameters without a swapped state, updated before batch 0 (while its copy-in runs); no slots, no copies."""
    walk_every_batch: bool = False
    """Every batch runs every step, with or without gradients (rank-independent batches: the ranks of a distributed
    adapter meet in collectives batch by batch); else a batch without any gradient is skipped."""

    @property
    def peak_staging_bytes(self) -> int:
        """Device bytes of swapped state held at once during a step."""
        return self.staging.peak_bytes

    def flip_host_copies(self) -> None:
        """The store flipped its copies (:meth:`StateStore.flip`): each batch's transfers go to the new mirrors."""
        for batch in self.batches:
            batch.transfers, batch.spare_transfers = batch.spare_transfers, batch.transfers


@dataclasses.dataclass(frozen=True)
class Partition:
    """How the parameters are cut into batches (see :func:`build_plan`)."""

    num_batches: int
    max_batch_bytes: int | None
    costs: Sequence[int] | None
    """Per-parameter batching costs (an adapter's rank-independent ones), or ``None``: the swapped bytes."""
    state: Mapping[torch.Tensor, dict[str, Any]]
    """The optimizer's state mapping."""
    resident_first: bool = False
    reverse: bool = False
    staging_buffers: int = 2
    """Batches staged on the device at a time (``SwapConfig.staging_buffers``)."""


def build_plan(
    store: StateStore,
    backend: DeviceBackend,
    params: Sequence[tuple[int, torch.Tensor]],
    partition: Partition,
    *,
    walk_every_batch: bool = False,
    keep_staging: bool = False,
) -> SwapPlan:
    """Partition ``params`` into batches, stage them (:func:`~swap_core.runtime.staging.stage_batches`) and bind them
    to ``state``.

    ``partition.state`` is the optimizer's state mapping: each batch keeps the state dict of each of its
    parameters (``None`` for one without state yet), so that a step looks nothing up by tensor.

    ``partition.resident_first``: parameters whose existing states all stay on the device go to the plan's
    ``resident`` batch instead (only when something is swapped). Not with an adapter's rank-independent costs:
    every rank must then walk the same batches, and residency is decided per rank. ``partition.reverse``: the
    batches are walked from the last parameters to the first (the order in which a backward finalizes their
    gradients); the split is the same. ``walk_every_batch``: see :attr:`SwapPlan.walk_every_batch`.
    ``keep_staging``: the staging arenas stay allocated between steps.
    """
    batches, spans, resident, slots_of, nbytes = _partitioned(store, params, partition)
    staging = stage_batches(
        store.packed_host,
        backend,
        batches,
        buffers=partition.staging_buffers,
        keep=keep_staging,
        spare=store.spare_host,
    )
    for batch in batches:
        pairs = zip(batch.slots, batch.device_views, strict=True)
        batch.update_views = [wrap_local(view, slot.layout) for slot, view in pairs]
    resident_batch = _batch(RESIDENT_BATCH_INDEX, sorted(resident), params, slots_of, nbytes) if resident else None
    walked = [*([resident_batch] if resident_batch is not None else []), *batches]
    positions = [*([sorted(resident)] if resident else []), *spans]
    assert sum(map(len, positions)) == len(params), "the batches cover every parameter once"
    all_states_exist = _bind_states(walked, positions, partition.state)
    return SwapPlan(
        batches=batches,
        staging=staging,
        version=store.version,
        param_count=len(params),
        all_states_exist=all_states_exist,
        resident=resident_batch,
        walk_every_batch=walk_every_batch,
    )


def staging_bytes(store: StateStore, params: Sequence[tuple[int, torch.Tensor]], partition: Partition) -> int:
    """The :attr:`SwapPlan.peak_staging_bytes` that :func:`build_plan` would give, without allocating anything (how
    ``swap_times="auto"`` compares batch counts)."""
    batches, *_ = _partitioned(store, params, partition)
    return staging_peak_bytes(store.packed_host, batches, buffers=partition.staging_buffers)


def _partitioned(
    store: StateStore, params: Sequence[tuple[int, torch.Tensor]], partition: Partition
) -> tuple[list[PlannedBatch], list[list[int]], set[int], list[list[SwapSlot]], list[int]]:
    """The batches (not staged, not bound), their parameters' positions, the resident positions, and each
    parameter's slots and swapped bytes."""
    slots_of = [list(store.slots.get(param, {}).values()) for _, param in params]
    nbytes = [sum(slot.nbytes for slot in slots) for slots in slots_of]
    costs, num_batches, state = partition.costs, partition.num_batches, partition.state
    if costs is None:
        costs = nbytes
        if sum(nbytes) == 0:
            num_batches = 1  # nothing moves: one batch, no copies
    elif len(costs) != len(params):
        raise ValueError(f"Adapter returned {len(costs)} partition costs for {len(params)} parameters")
    resident: set[int] = set()
    if partition.resident_first and sum(nbytes) > 0:
        resident = {i for i, (_, param) in enumerate(params) if not slots_of[i] and not _is_fresh(state.get(param))}
    swapped = [i for i in range(len(params)) if i not in resident]
    # Adapter costs are rank-independent: every rank must walk the same batches even when it swaps nothing.
    ranges = partition_consecutive(
        [costs[i] for i in swapped], num_batches=num_batches, max_batch_cost=partition.max_batch_bytes
    )
    spans = [swapped[span.start : span.stop] for span in ranges]
    if partition.reverse:
        spans.reverse()
    batches = [_batch(index, positions, params, slots_of, nbytes) for index, positions in enumerate(spans)]
    return batches, spans, resident, slots_of, nbytes


def _batch(
    index: int,
    positions: list[int],
    params: Sequence[tuple[int, torch.Tensor]],
    slots_of: list[list[SwapSlot]],
    nbytes: list[int],
) -> PlannedBatch:
    """The batch of the parameters at ``positions`` (ascending) among all parameters in order."""
    return PlannedBatch(
        index=index,
        params=[params[i] for i in positions],
        slots=[slot for i in positions for slot in slots_of[i]],
        nbytes=sum(nbytes[i] for i in positions),
    )


def _is_fresh(state: dict[str, Any] | None) -> bool:
    return state is None or is_fresh(state)


def _bind_states(
    batches: list[PlannedBatch], positions: list[list[int]], state: Mapping[torch.Tensor, dict[str, Any]]
) -> bool:
    """Fill each batch's ``segments`` and ``slot_states``; returns whether every parameter has a state.

    ``positions[i]`` are the indices of ``batches[i]``'s parameters among all parameters in order.
    """
    every_state = True
    for batch, batch_positions in zip(batches, positions, strict=True):
        batch.segments = []
        for group_index, members, where in _runs(batch.params, batch_positions):
            # .get: binding must not create entries (torch keeps no state for never-updated params).
            states = [state.get(param) for param in members]
            every_state = every_state and not any(map(_is_fresh, states))
            batch.segments.append((group_index, members, states, where))
        batch.slot_states = [state[slot.param] for slot in batch.slots]
        # A state kept in a dict nested in its entry (a path) is found there at each update.
        batch.nested_slots = any(
            slot.key not in entry for slot, entry in zip(batch.slots, batch.slot_states, strict=True)
        )
    return every_state


def _runs(
    params: list[tuple[int, torch.Tensor]], positions: list[int]
) -> Iterator[tuple[int, list[torch.Tensor], GradientPositions]]:
    """``(group index, parameters, their positions)`` of each run of one param group.

    A run's positions among all parameters are a slice, unless resident parameters taken out of the
    batch leave gaps: then a list (a step gathers those gradients one by one, still one update call).
    """
    run_start = 0
    for end in range(1, len(params) + 1):
        if end < len(params) and params[end][0] == params[end - 1][0]:
            continue
        run = positions[run_start:end]
        where: GradientPositions = run
        if run[-1] - run[0] == len(run) - 1:
            where = slice(run[0], run[-1] + 1)
        yield params[run_start][0], [param for _, param in params[run_start:end]], where
        run_start = end
