"""Packed memory: one host buffer per dtype, device staging arenas.

Host side, every swapped state of a dtype lives in persistent pinned buffers,
laid out in batch order, so a batch is one contiguous range per dtype and moves
with a single copy. A dtype's buffer comes in chunks of at most the backend's
``max_host_buffer_bytes`` (some drivers refuse to pin more at once): a batch whose
range crosses a chunk's end moves with one copy per chunk it touches, each into its
place in the batch's region of the arena. Device side, the arenas (two by default,
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
    "Piece",
    "StagingArenas",
    "Transfer",
    "arena_bytes",
    "arena_region_order",
    "placed_pieces",
    "split_at_middle",
]

SLOT_ALIGN_BYTES = 64
"""Alignment of each state inside a packed buffer (keeps vectorized kernels on their fast path)."""

ARENA_ALIGN_BYTES = 512
"""Alignment of each dtype region inside a staging arena."""


Piece = tuple[int, int, int]
"""``(chunk, start, stop)``: an element range of one chunk of a dtype's host buffer."""


class PackedHost:
    """Per-dtype host buffers holding swapped states at fixed element offsets, each dtype's in chunks of at most
    ``backend.max_host_buffer_bytes`` (a state larger than that alone in a chunk of its own size)."""

    def __init__(self, backend: DeviceBackend, slots: Sequence[SwapSlot], *, mode: HostMemoryMode = "exact") -> None:
        self.offsets, sizes = _layout(slots, backend.max_host_buffer_bytes)
        """Each slot's chunk and element offset in its dtype's buffer."""
        self.buffers = {
            dtype: [backend.empty_host(numel, dtype, mode=mode) for numel in chunks] for dtype, chunks in sizes.items()
        }
        """Each dtype's chunks."""
        self.pinned_bytes = sum(backend.pinned_bytes(chunk) for chunks in self.buffers.values() for chunk in chunks)
        """Host bytes pinned for the buffers, rounding included (0 for pageable ones)."""

    @staticmethod
    def required_pinned_bytes(slots: Sequence[SwapSlot], mode: HostMemoryMode, max_buffer_bytes: int) -> int:
        """The pinned bytes a layout of ``slots`` in chunks of ``max_buffer_bytes`` will take (checked before
        allocating)."""
        _, sizes = _layout(slots, max_buffer_bytes)
        return sum(pinned_size(numel * dtype.itemsize, mode) for dtype, chunks in sizes.items() for numel in chunks)

    def view(self, slot: SwapSlot) -> torch.Tensor:
        """The slot's host mirror: a shaped view into its dtype's buffer."""
        chunk, start = self.offsets[slot]
        return slot.shaped(self.buffers[slot.dtype][chunk][start : start + slot.numel])

    def pieces(self, slots: Iterable[SwapSlot]) -> dict[torch.dtype, list[Piece]]:
        """Per dtype, the ranges covering ``slots`` (consecutive in the layout): one per chunk they touch, in order."""
        ranges: dict[tuple[torch.dtype, int], tuple[int, int]] = {}
        for slot in slots:
            chunk, start = self.offsets[slot]
            stop = start + slot.numel
            low, high = ranges.get((slot.dtype, chunk), (start, stop))
            ranges[slot.dtype, chunk] = (min(low, start), max(high, stop))
        pieces: dict[torch.dtype, list[Piece]] = {}
        for (dtype, chunk), (start, stop) in sorted(ranges.items(), key=lambda item: item[0][1]):
            pieces.setdefault(dtype, []).append((chunk, start, stop))
        return pieces

    @property
    def nbytes(self) -> int:
        return sum(chunk.numel() * chunk.element_size() for chunks in self.buffers.values() for chunk in chunks)


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
        for dtype, nbytes in arena_region_order(region_bytes):
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


def placed_pieces(dtype: torch.dtype, pieces: Sequence[Piece]) -> tuple[list[int], int]:
    """Where each of a batch's ``pieces`` of ``dtype`` starts in the batch's region of an arena (in elements, each
    64-byte aligned, in order), and the region's elements."""
    align = SLOT_ALIGN_BYTES // dtype.itemsize
    starts: list[int] = []
    end = 0
    for _, start, stop in pieces:
        starts.append(align_up(end, align))
        end = starts[-1] + stop - start
    return starts, end


def _layout(
    slots: Sequence[SwapSlot], max_buffer_bytes: int
) -> tuple[dict[SwapSlot, tuple[int, int]], dict[torch.dtype, list[int]]]:
    """Each slot's chunk and element offset in its dtype's buffer (64-byte aligned), and each chunk's element count:
    a chunk ends where the next slot would take it over ``max_buffer_bytes``."""
    offsets: dict[SwapSlot, tuple[int, int]] = {}
    sizes: dict[torch.dtype, list[int]] = {}
    for slot in slots:
        chunks = sizes.setdefault(slot.dtype, [0])
        start = align_up(chunks[-1], SLOT_ALIGN_BYTES // slot.dtype.itemsize)
        if chunks[-1] > 0 and (start + slot.numel) * slot.dtype.itemsize > max_buffer_bytes:
            chunks.append(0)
            start = 0
        offsets[slot] = (len(chunks) - 1, start)
        chunks[-1] = start + slot.numel
    return offsets, sizes


def arena_region_order(region_bytes: Mapping[torch.dtype, int]) -> list[tuple[torch.dtype, int]]:
    """The order dtype regions take in an arena (deterministic, by dtype name)."""
    return sorted(region_bytes.items(), key=lambda item: str(item[0]))


def arena_bytes(region_bytes: Mapping[torch.dtype, int]) -> int:
    """Arena bytes one batch needs: each dtype region rounded up to 512 bytes."""
    return sum(align_up(nbytes, ARENA_ALIGN_BYTES) for _, nbytes in arena_region_order(region_bytes))
