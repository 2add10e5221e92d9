"""Packed memory: one host buffer per dtype, device staging arenas.

Host side, every swapped state of a dtype lives in one persistent pinned buffer,
laid out in batch order, so a batch is one contiguous range per dtype and moves
with a single copy. Device side, the arenas (two by default,
``SwapConfig.staging_buffers``) take the batches in turn: while batch ``i`` is
updated in one, batch ``i + 1`` streams into the next. Each arena is as large as
the largest batch it stages (with two, the even batches in one, the odd in the
other), so uneven batches (a rank of distributed Muon owning one large matrix)
do not pay for every arena at the largest size.

With more batches than arenas, batch ``i + 1`` reuses the arena that the batch
``staging_buffers`` before it (with two, batch ``i - 1``) is still being copied
out of. Each copy is then cut where it crosses the middle of the arena
(:func:`split_at_middle`): the copy-in of the first half only waits for the
copy-out of the first half, which finished while the second half was still
streaming out, so the copy-in stream does not idle for a whole update.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from ..alignment import align_up
from ..backends.host_memory import HostMemoryMode, pinned_size
from ..backends.protocol import DeviceBackend, Stream
from .slots import SwapSlot

__all__ = [
    "ARENA_ALIGN_BYTES",
    "SLOT_ALIGN_BYTES",
    "PackedHost",
    "StagingArenas",
    "arena_bytes",
    "arena_layout",
    "split_at_middle",
]

SLOT_ALIGN_BYTES = 64
"""Alignment of each state inside a packed buffer (keeps vectorized kernels on their fast path)."""

ARENA_ALIGN_BYTES = 512
"""Alignment of each dtype region inside a staging arena."""


class PackedHost:
    """Per-dtype host buffers holding swapped states at fixed element offsets."""

    def __init__(self, backend: DeviceBackend, slots: Sequence[SwapSlot], *, mode: HostMemoryMode = "exact") -> None:
        self.offsets, sizes = _layout(slots)
        self.buffers = {dtype: backend.empty_host(numel, dtype, mode=mode) for dtype, numel in sizes.items()}
        self.pinned_bytes = sum(backend.pinned_bytes(buffer) for buffer in self.buffers.values())
        """Host bytes pinned for the buffers, rounding included (0 for pageable ones)."""

    @staticmethod
    def required_pinned_bytes(slots: Sequence[SwapSlot], mode: HostMemoryMode) -> int:
        """The pinned bytes a layout of ``slots`` will take (to check before allocating)."""
        _, sizes = _layout(slots)
        return sum(pinned_size(numel * dtype.itemsize, mode) for dtype, numel in sizes.items())

    def view(self, slot: SwapSlot) -> torch.Tensor:
        """The slot's host mirror: a shaped view into its dtype's buffer."""
        start = self.offsets[slot]
        return slot.shaped(self.buffers[slot.dtype][start : start + slot.numel])

    def ranges(self, slots: Iterable[SwapSlot]) -> dict[torch.dtype, tuple[int, int]]:
        """Element range per dtype covering ``slots`` (consecutive in the layout)."""
        ranges: dict[torch.dtype, tuple[int, int]] = {}
        for slot in slots:
            start = self.offsets[slot]
            stop = start + slot.numel
            low, high = ranges.get(slot.dtype, (start, stop))
            ranges[slot.dtype] = (min(low, start), max(high, stop))
        return ranges

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers.values())


class StagingArenas:
    """Device buffers (one per batch staged at a time, at most one per batch) whose storage lives only during a
    step.

    Each batch lays its dtypes out in its arena at 512-byte aligned offsets, so an
    arena is as large as the largest batch it stages (all dtypes together), not the
    sum of every dtype's largest batch. The arena tensors and every view into them
    are created once; between steps only their storage is released, so a step
    creates no Python views at all.
    """

    def __init__(self, backend: DeviceBackend, sizes: Sequence[int]) -> None:
        """``sizes``: the bytes of each arena (at least one)."""
        if not sizes:
            raise ValueError("Invalid staging arena count: 0 (at least one)")
        self._backend = backend
        self.sizes = [align_up(nbytes, ARENA_ALIGN_BYTES) for nbytes in sizes]
        self.arenas = [backend.empty((nbytes,), torch.uint8) for nbytes in self.sizes]
        # Allocated until the plan has cut its views (views cannot be taken of released storage).
        self.allocated = True

    def regions(self, index: int, region_bytes: Mapping[torch.dtype, int]) -> dict[torch.dtype, torch.Tensor]:
        """One typed view per dtype in arena ``index``, at consecutive 512-byte aligned offsets."""
        arena = self.arenas[index]
        views: dict[torch.dtype, torch.Tensor] = {}
        offset = 0
        for dtype, nbytes in arena_layout(region_bytes):
            views[dtype] = arena[offset : offset + nbytes].view(dtype)
            offset += align_up(nbytes, ARENA_ALIGN_BYTES)
        return views

    def middle(self, index: int) -> int:
        """The byte offset that splits arena ``index`` in two halves (512-byte aligned)."""
        return align_up(self.sizes[index] // 2, ARENA_ALIGN_BYTES)

    @property
    def total_bytes(self) -> int:
        """Device bytes held while allocated."""
        return sum(self.sizes)

    def acquire(self) -> None:
        """Allocate every arena, or none: an out-of-memory on a later arena gives back the earlier ones (a retry with
        more batches must find the memory as it was before this attempt)."""
        if self.allocated:
            return
        restored: list[torch.Tensor] = []
        try:
            for arena in self.arenas:
                self._backend.restore_storage(arena)
                restored.append(arena)
        except BaseException:
            for arena in restored:  # nothing was issued on them yet
                self._backend.release_storage(arena, in_use_on=None)
            raise
        self.allocated = True

    def release(self, *, in_use_on: Stream | None = None) -> None:
        """Free the arenas (stream-ordered behind the work issued to ``in_use_on``, see ``release_storage``)."""
        if self.allocated:
            for arena in self.arenas:
                self._backend.release_storage(arena, in_use_on=in_use_on)
            self.allocated = False


Transfer = tuple[torch.Tensor, torch.Tensor]
"""``(host, device)``: a host buffer range and the arena view it is copied to and from."""


def split_at_middle(transfers: Sequence[Transfer], middle: int) -> tuple[list[Transfer], int]:
    """``transfers`` cut where their arena view crosses byte ``middle``: the pieces below it first.

    Returns the copies and how many of them lie below ``middle``. Arena views start at 512-byte aligned
    offsets and ``middle`` is one, so every cut falls on an element boundary.
    """
    below: list[Transfer] = []
    above: list[Transfer] = []
    for host, device in transfers:
        start = device.storage_offset() * device.element_size()
        stop = start + device.numel() * device.element_size()
        if stop <= middle:
            below.append((host, device))
        elif start >= middle:
            above.append((host, device))
        else:
            cut = (middle - start) // device.element_size()
            below.append((host[:cut], device[:cut]))
            above.append((host[cut:], device[cut:]))
    return below + above, len(below)


def _layout(slots: Sequence[SwapSlot]) -> tuple[dict[SwapSlot, int], dict[torch.dtype, int]]:
    """Each slot's element offset in its dtype's buffer (64-byte aligned), and each buffer's element count."""
    offsets: dict[SwapSlot, int] = {}
    sizes: dict[torch.dtype, int] = {}
    for slot in slots:
        align = SLOT_ALIGN_BYTES // slot.dtype.itemsize
        start = align_up(sizes.get(slot.dtype, 0), align)
        offsets[slot] = start
        sizes[slot.dtype] = start + slot.numel
    return offsets, sizes


def arena_layout(region_bytes: Mapping[torch.dtype, int]) -> list[tuple[torch.dtype, int]]:
    """The order dtype regions take in an arena (deterministic, by dtype name)."""
    return sorted(region_bytes.items(), key=lambda item: str(item[0]))


def arena_bytes(region_bytes: Mapping[torch.dtype, int]) -> int:
    """Arena bytes one batch needs: each dtype region rounded up to 512 bytes."""
    return sum(align_up(nbytes, ARENA_ALIGN_BYTES) for _, nbytes in arena_layout(region_bytes))
