"""Where a plan's batches live on the device during a step: packed arenas, or each state's own storage.

A :class:`Staging` is chosen once per plan (:func:`stage_batches`), from the store's host layout: packed host
buffers are staged in :class:`ArenaStaging` (``buffers`` arenas, one copy per dtype and batch), per-tensor host
buffers in :class:`PerTensorStaging` (each state's own device storage, restored one batch ahead). The pipeline walks
a step through a :class:`StagingWalk` and never asks which one it has.

``buffers`` batches are staged at a time (``SwapConfig.staging_buffers``, 2 by default). Both hand the memory of
batch ``i - buffers`` to batch ``i`` and order that hand-over after batch ``i - buffers``'s copy-out: the arenas by
a copy-in that waits for the copy-out half by half, the storages by releasing them on the compute stream once the
copy-out is done, so that the restore on that stream reuses them. With two, batch ``i + 1``'s copy-in can only
start once batch ``i - 1``'s copy-out, which follows that batch's update, has read the memory; each more buffer
lets the copy-ins run one more batch ahead of the copy-outs, for one more batch of device memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

import torch

from ..alignment import align_up
from ..backends.protocol import DeviceBackend, Event, Stream
from ..errors import SwapStateError
from .packed import (
    ARENA_ALIGN_BYTES,
    PackedHost,
    Piece,
    StagingArenas,
    Transfer,
    arena_bytes,
    placed_pieces,
    split_at_middle,
)
from .planned_batch import PlannedBatch
from .slots import SwapSlot

__all__ = [
    "ArenaStaging",
    "Offloaded",
    "PerTensorStaging",
    "Staging",
    "StagingWalk",
    "stage_batches",
    "staging_peak_bytes",
]


class Offloaded(NamedTuple):
    """Events of one batch's offload: its copies of the arena's first half done, and all of them done."""

    front: Event
    done: Event


class StagingWalk(Protocol):
    """One step's walk over the staged batches (``batches[position]``, in the order they are copied in)."""

    def before_copy_in(self, position: int) -> Offloaded | None:
        """Make the batch's device memory ready on the compute stream; returns the copy-out the copy-in must wait
        for, half by half (``None``: nothing)."""
        ...

    def copied_out(self, position: int, offloaded: Offloaded) -> None:
        """The batch's copy-out is issued: its memory goes to a later batch once ``offloaded`` is done."""
        ...

    def needs_memory_of(self, position: int, earlier: int) -> bool:
        """Whether batch ``position`` takes the memory batch ``earlier`` still uses, so that its copy-in can only be
        issued after ``earlier``'s copy-out (batches skipped between them)."""
        ...


class Staging(Protocol):
    """A plan's staging memory (see the module)."""

    @property
    def peak_bytes(self) -> int:
        """Device bytes of swapped state held at once during a step."""
        ...

    def acquire(self) -> None:
        """Before a step's (or a prefetch's) first copy-in: memory allocated for the whole step, if any."""
        ...

    def walk(self, batches: Sequence[PlannedBatch], compute: Stream) -> StagingWalk:
        """A step's walk over ``batches``, whose updates run on ``compute``."""
        ...

    def release(self, batches: Sequence[PlannedBatch], *, in_use_on: Stream | None) -> None:
        """Free what ``batches`` hold (the arenas: all of it), stream-ordered behind the work issued to
        ``in_use_on`` (``None``: the work using it is done)."""
        ...

    def release_after_walk(self, batches: Sequence[PlannedBatch], *, in_use_on: Stream) -> bool:
        """After a walk over ``batches``: free what the last copy-outs still read, behind them (``in_use_on``), unless
        the staging is kept between steps (``SwapConfig.keep_staging``); returns whether it was kept."""
        ...


class ArenaStaging:
    """Packed host buffers staged in ``buffers`` device arenas that take the batches in turn (see :mod:`.packed`)."""

    def __init__(self, arenas: StagingArenas, buffers: int, *, keep: bool) -> None:
        """``keep``: the arenas stay allocated between steps."""
        self.arenas = arenas
        self._buffers = buffers
        self._keep = keep

    @classmethod
    def lay_out(
        cls,
        packed: PackedHost,
        backend: DeviceBackend,
        batches: Sequence[PlannedBatch],
        buffers: int,
        *,
        keep: bool,
        spare: PackedHost | None = None,
    ) -> ArenaStaging:
        """Cut each batch's views and transfers out of new arenas (released again until a step acquires them), and its
        transfers to and from ``spare`` (the packed spare copy, same layout) where there is one."""
        pieces = [packed.pieces(batch.slots) for batch in batches]
        arenas = StagingArenas(backend, _arena_sizes(pieces, batches, buffers))
        # An arena is reused (by batch i, while batch i - buffers is copied out of it) only with more batches.
        reused = len(batches) > buffers
        for batch, batch_pieces in zip(batches, pieces, strict=True):
            index = batch.index % buffers
            placed = {dtype: placed_pieces(dtype, dtype_pieces) for dtype, dtype_pieces in batch_pieces.items()}
            regions = arenas.regions(index, {dtype: end * dtype.itemsize for dtype, (_, end) in placed.items()})
            middle = arenas.middle(index) if reused else arenas.sizes[index]
            whole = _transfers(packed, batch_pieces, placed, regions)
            batch.transfers, batch.front_transfers = split_at_middle(whole, middle)
            if spare is not None:
                batch.spare_transfers, _ = split_at_middle(_transfers(spare, batch_pieces, placed, regions), middle)
            at = {
                (dtype, chunk): device_start - start
                for dtype, dtype_pieces in batch_pieces.items()
                for (chunk, start, _), device_start in zip(dtype_pieces, placed[dtype][0], strict=True)
            }
            for slot in batch.slots:
                chunk, offset = packed.offsets[slot]
                start = at[slot.dtype, chunk] + offset
                batch.device_views.append(slot.shaped(regions[slot.dtype][start : start + slot.numel]))
        arenas.release()
        return cls(arenas, buffers, keep=keep)

    @property
    def peak_bytes(self) -> int:
        return self.arenas.total_bytes

    def acquire(self) -> None:
        self.arenas.acquire()

    def walk(self, batches: Sequence[PlannedBatch], compute: Stream) -> StagingWalk:
        return _ArenaWalk(batches, self._buffers)

    def release(self, batches: Sequence[PlannedBatch], *, in_use_on: Stream | None) -> None:
        self.arenas.release(in_use_on=in_use_on)

    def release_after_walk(self, batches: Sequence[PlannedBatch], *, in_use_on: Stream) -> bool:
        if not self._keep:
            self.arenas.release(in_use_on=in_use_on)
        return self._keep


class _ArenaWalk:
    """A copy-in into an arena waits, half by half, for the last copy-out out of it."""

    def __init__(self, batches: Sequence[PlannedBatch], buffers: int) -> None:
        self._arena_of = [batch.index % buffers for batch in batches]
        self._last_out_of: dict[int, Offloaded] = {}

    def before_copy_in(self, position: int) -> Offloaded | None:
        return self._last_out_of.get(self._arena_of[position])

    def copied_out(self, position: int, offloaded: Offloaded) -> None:
        self._last_out_of[self._arena_of[position]] = offloaded

    def needs_memory_of(self, position: int, earlier: int) -> bool:
        return self._arena_of[position] == self._arena_of[earlier]


class PerTensorStaging:
    """Per-tensor host buffers staged in each state's own device storage, restored one batch ahead of its update
    and released once its copy-out is done; ``buffers`` batches hold their storages at a time."""

    def __init__(self, backend: DeviceBackend, batches: Sequence[PlannedBatch], buffers: int) -> None:
        self._backend = backend
        self._buffers = buffers
        self._peak = _window_peak([batch.nbytes for batch in batches], buffers)

    @classmethod
    def lay_out(cls, backend: DeviceBackend, batches: Sequence[PlannedBatch], buffers: int) -> PerTensorStaging:
        """Each batch's views are its slots' device tensors, each copied to and from its own host buffer."""
        for batch in batches:
            batch.device_views = [_device_tensor(slot) for slot in batch.slots]
            batch.transfers = [
                (slot.host_mirror, view) for slot, view in zip(batch.slots, batch.device_views, strict=True)
            ]
            batch.spare_transfers = [
                (slot.spare, view)
                for slot, view in zip(batch.slots, batch.device_views, strict=True)
                if slot.spare is not None
            ]
            batch.front_transfers = len(batch.transfers)
        return cls(backend, batches, buffers)

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def acquire(self) -> None:
        """Nothing: each batch's storages are restored before its copy-in."""

    def walk(self, batches: Sequence[PlannedBatch], compute: Stream) -> StagingWalk:
        return _PerTensorWalk(self._backend, batches, compute, self._buffers)

    def release(self, batches: Sequence[PlannedBatch], *, in_use_on: Stream | None) -> None:
        for batch in batches:
            for view in batch.device_views:
                if view.untyped_storage().nbytes() > 0:
                    self._backend.release_storage(view, in_use_on=in_use_on)

    def release_after_walk(self, batches: Sequence[PlannedBatch], *, in_use_on: Stream) -> bool:
        """The storages of the batches within ``buffers`` of the last one in the plan (the walk released the
        earlier ones for later batches). Nothing is kept between steps: each storage is one state's own, and
        keeping them would keep every state on the device."""
        last = batches[-1].index if batches else 0
        for batch in (batch for batch in batches if batch.index > last - self._buffers):
            for view in batch.device_views:
                self._backend.release_storage(view, in_use_on=in_use_on)
        return False


class _PerTensorWalk:
    """Batch ``i`` restores its storages on the compute stream after the storages of batch ``i - buffers`` (and of
    any batch walked before it) were released there, once their copy-outs are done: the restore takes the same
    memory. Only batches within ``buffers`` neighbours of the plan hold storages at once, whichever batches the
    step skips (those without gradients), so the peak stays the plan's."""

    def __init__(self, backend: DeviceBackend, batches: Sequence[PlannedBatch], compute: Stream, buffers: int) -> None:
        self._backend, self._batches, self._compute = backend, batches, compute
        self._buffers = buffers
        self._offloaded: dict[int, Offloaded] = {}
        """Positions copied out whose storages are still held, in walk order."""

    def before_copy_in(self, position: int) -> Offloaded | None:
        backend = self._backend
        for earlier in [earlier for earlier in self._offloaded if self.needs_memory_of(position, earlier)]:
            backend.wait_event(self._compute, self._offloaded.pop(earlier).done)
            for view in self._batches[earlier].device_views:
                backend.release_storage(view, in_use_on=self._compute)
        for view in self._batches[position].device_views:
            backend.restore_storage(view)
        return None

    def copied_out(self, position: int, offloaded: Offloaded) -> None:
        self._offloaded[position] = offloaded

    def needs_memory_of(self, position: int, earlier: int) -> bool:
        """Batch ``earlier`` lies ``buffers`` or more batches before batch ``position`` in the plan."""
        return self._batches[earlier].index <= self._batches[position].index - self._buffers


def stage_batches(
    store_packed: PackedHost | None,
    backend: DeviceBackend,
    batches: Sequence[PlannedBatch],
    *,
    buffers: int = 2,
    keep: bool = False,
    spare: PackedHost | None = None,
) -> Staging:
    """The staging of ``batches``, ``buffers`` of them at a time: arenas over a packed host layout (when anything
    is swapped; ``keep``: allocated between steps too; ``spare``: the packed spare copy), else each state's own
    storage."""
    if store_packed is not None and sum(batch.nbytes for batch in batches) > 0:
        return ArenaStaging.lay_out(store_packed, backend, batches, buffers, keep=keep, spare=spare)
    return PerTensorStaging.lay_out(backend, batches, buffers)


def staging_peak_bytes(store_packed: PackedHost | None, batches: Sequence[PlannedBatch], *, buffers: int = 2) -> int:
    """The :attr:`Staging.peak_bytes` that :func:`stage_batches` would give, without allocating anything."""
    if store_packed is not None and sum(batch.nbytes for batch in batches) > 0:
        pieces = [store_packed.pieces(batch.slots) for batch in batches]
        return sum(align_up(size, ARENA_ALIGN_BYTES) for size in _arena_sizes(pieces, batches, buffers))
    return _window_peak([batch.nbytes for batch in batches], buffers)


def _window_peak(sizes: Sequence[int], buffers: int) -> int:
    """``buffers`` consecutive batches staged at a time: the largest such run (or all of them, if fewer)."""
    if len(sizes) <= buffers:
        return sum(sizes)
    return max(sum(sizes[start : start + buffers]) for start in range(len(sizes) - buffers + 1))


def _transfers(
    host: PackedHost,
    pieces: Mapping[torch.dtype, Sequence[Piece]],
    placed: Mapping[torch.dtype, tuple[list[int], int]],
    regions: Mapping[torch.dtype, torch.Tensor],
) -> list[Transfer]:
    """One ``(host range, arena view)`` per piece of a batch, in the order of its regions."""
    return [
        (host.buffers[dtype][chunk][start:stop], regions[dtype][at : at + stop - start])
        for dtype, dtype_pieces in pieces.items()
        for (chunk, start, stop), at in zip(dtype_pieces, placed[dtype][0], strict=True)
    ]


def _region_bytes(pieces: Mapping[torch.dtype, Sequence[Piece]]) -> dict[torch.dtype, int]:
    return {dtype: placed_pieces(dtype, dtype_pieces)[1] * dtype.itemsize for dtype, dtype_pieces in pieces.items()}


def _arena_sizes(
    pieces: Sequence[Mapping[torch.dtype, Sequence[Piece]]], batches: Sequence[PlannedBatch], buffers: int
) -> list[int]:
    """Arena ``j`` stages the batches whose index is ``j`` modulo ``buffers``: each is as large as the largest of
    those."""
    sizes = [0] * min(buffers, len(batches))
    for batch, batch_pieces in zip(batches, pieces, strict=True):
        index = batch.index % buffers
        sizes[index] = max(sizes[index], arena_bytes(_region_bytes(batch_pieces)))
    return sizes


def _device_tensor(slot: SwapSlot) -> torch.Tensor:
    if slot.device is None:
        raise SwapStateError(f"{slot!r} has no device tensor")
    return slot.device
