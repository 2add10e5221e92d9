"""Which CPU storages the simulator treats as host or device memory, and how many device bytes are live.

Storages are keyed by their StorageImpl address (:func:`swap_core.torch_compat.storage_id`), which
stays the same across ``resize_``, so a storage released and restored keeps its identity. A record is
dropped when the tensor that registered it is garbage collected (``weakref.finalize``): the address
may then be reused by an unrelated storage, which must start as a plain tensor with no history. Views
keep their ``_base`` alive, so a view in use keeps its record; an alias made without ``_base``
(``detach()``, ``set_``) does not, and its storage then becomes plain (fewer checks, never a false
report).
"""

from __future__ import annotations

import collections
import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .streams import QueuedRelease, SimStream

from ...torch_compat import storage_id

__all__ = [
    "HOST_KINDS",
    "MemoryKind",
    "MemoryRegistry",
    "StorageRecord",
    "byte_span",
    "poison_storage",
    "storage_key",
    "storage_too_small",
]


class MemoryKind(enum.Enum):
    """What a registered storage simulates; unregistered CPU storages are *plain* (neutral)."""

    DEVICE = "device"
    HOST = "host"
    PAGEABLE_HOST = "pageable host"


HOST_KINDS = frozenset({MemoryKind.HOST, MemoryKind.PAGEABLE_HOST})
"""Kinds that are host memory, whether pinned or not."""

POISON_BYTE = 0xFF
"""All-ones bytes read as NaN in fp32/bf16/fp16 and -1 in integers: a missing wait shows as a wrong number."""


@dataclass(eq=False, slots=True)
class StorageRecord:
    """One registered storage: its kind and the device bytes the accounting holds for it."""

    kind: MemoryKind
    counted_bytes: int = 0
    retained: bool = False
    """Released with checks off: uncounted, its bytes still mapped as a cached block (see ``caching_allocator``)."""
    pending_release: QueuedRelease | None = None
    """Released stream-ordered (``in_use_on``) and not restored since: the queued free of its bytes."""
    stream: SimStream | None = None
    """The stream that was current when its bytes were allocated (``empty``, ``restore_storage``); ``None`` for
    adopted and plain tensors (the default compute stream's)."""
    pinned_bytes: int = 0
    """Host bytes a real pinned buffer of this size would hold (rounding included); 0 for device or pageable."""
    registered: bool = False
    """Host memory registered with the driver (``host_memory="exact"``): nothing but the program keeps it alive
    while a copy uses it (torch's caching pinned allocator records events and defers reuse; registered memory
    has no such guard)."""
    finalizer: weakref.finalize[[int, StorageRecord], torch.Tensor] | None = field(default=None, repr=False)
    is_host: bool = field(init=False)
    """Flags precomputed from ``kind``: the copy path tests them on every call."""
    is_pageable: bool = field(init=False)

    def __post_init__(self) -> None:
        self.is_host = self.kind in HOST_KINDS
        self.is_pageable = self.kind is MemoryKind.PAGEABLE_HOST


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage, stable across ``resize_``."""
    return storage_id(tensor.untyped_storage())


def byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` of its storage that a non-empty ``tensor`` can touch.

    Conservative for non-contiguous layouts: the span from the first to the last
    element, gaps included (a false overlap only costs an extra wait in a test).
    """
    element_size = tensor.element_size()
    offset = tensor.storage_offset()
    extent = 1
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        extent += (size - 1) * stride
    return int(offset * element_size), int((offset + extent) * element_size)


def storage_too_small(tensor: torch.Tensor) -> bool:
    """Whether touching ``tensor`` would read past its storage (released storage would crash the process)."""
    held = tensor.untyped_storage().nbytes()
    if tensor.is_contiguous() and held >= (tensor.storage_offset() + tensor.numel()) * tensor.element_size():
        return False
    return tensor.numel() > 0 and held < byte_span(tensor)[1]


def poison_storage(tensor: torch.Tensor) -> None:
    """Fill the whole storage with 0xFF bytes so that reading it before a copy lands gives NaN."""
    storage = tensor.untyped_storage()
    if storage.nbytes() > 0:
        torch.empty(0, dtype=torch.uint8).set_(storage).fill_(POISON_BYTE)


class MemoryRegistry:
    """Registered storages by key, and the exact device-byte accounting of the simulator.

    Only bytes allocated through ``empty`` and ``restore_storage`` are counted;
    adopted tensors (parameters, gradients) are device memory with nothing counted,
    like model weights allocated before a peak-memory reset.
    """

    def __init__(
        self,
        on_forget: Callable[[int], None],
        on_collect: Callable[[int, StorageRecord], None] | None = None,
        on_host_freed: Callable[[int, StorageRecord], None] | None = None,
    ) -> None:
        self.records: dict[int, StorageRecord] = {}
        """Registered storages by :func:`storage_key`; read directly on hot paths, changed only through methods."""
        self._on_forget = on_forget
        self._on_collect = on_collect
        """Told about a device storage whose tensor was collected, before its bytes are uncounted."""
        self._on_host_freed = on_host_freed
        """Told about a registered host buffer the program let go of, before its history is forgotten."""
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self.pinned_bytes = 0
        """Host bytes a real device would have pinned for the live host buffers (rounding included)."""
        self.cached_pinned: collections.Counter[int] = collections.Counter()
        """Blocks of torch's caching pinned allocator (``host_memory="caching"``) whose buffers were freed, by size:
        still pinned, reused by a request of their size, given back only by ``empty_host_cache``."""
        self.peak_pinned_bytes = 0

    def lookup(self, key: int) -> StorageRecord | None:
        """The record of a storage, ``None`` for a plain CPU storage."""
        return self.records.get(key)

    def register(self, tensor: torch.Tensor, kind: MemoryKind) -> StorageRecord:
        """Start tracking ``tensor``'s storage as new memory of ``kind``, forgetting any earlier record."""
        key = storage_key(tensor)
        previous = self.records.pop(key, None)
        if previous is not None:
            self._drop(previous)
        self._on_forget(key)
        record = StorageRecord(kind)
        owner = tensor._base if tensor._base is not None else tensor
        finalizer = weakref.finalize(owner, self._forget, key, record)
        finalizer.atexit = False
        record.finalizer = finalizer
        self.records[key] = record
        return record

    def count(self, record: StorageRecord, nbytes: int) -> None:
        """Account ``nbytes`` newly allocated for ``record``'s storage."""
        record.counted_bytes += nbytes
        self.allocated_bytes += nbytes
        if self.allocated_bytes > self.peak_bytes:
            self.peak_bytes = self.allocated_bytes

    def uncount(self, record: StorageRecord) -> None:
        """Give back whatever was counted for ``record`` (nothing for adopted tensors)."""
        self.allocated_bytes -= record.counted_bytes
        record.counted_bytes = 0

    def pin(self, record: StorageRecord, nbytes: int, *, registered: bool) -> None:
        """Account ``nbytes`` of pinned host memory behind ``record``'s (host) storage: registered with the driver,
        or a block of the caching pinned allocator (a cached block of that size is taken first)."""
        record.pinned_bytes = nbytes
        record.registered = registered
        self.pinned_bytes += nbytes
        if not registered and self.cached_pinned[nbytes] > 0:
            self.cached_pinned[nbytes] -= 1
        self.peak_pinned_bytes = max(self.peak_pinned_bytes, self.process_pinned_bytes)

    @property
    def process_pinned_bytes(self) -> int:
        """Pinned host bytes of the process: live buffers and the caching allocator's cached blocks."""
        return self.pinned_bytes + sum(size * count for size, count in self.cached_pinned.items())

    def empty_host_cache(self) -> None:
        """The caching pinned allocator gives every cached block back."""
        self.cached_pinned.clear()

    def reset_peak(self) -> None:
        self.peak_bytes = self.allocated_bytes
        self.peak_pinned_bytes = self.process_pinned_bytes

    def _forget(self, key: int, record: StorageRecord) -> None:
        """Finalizer of the registering tensor: its storage is gone, or is about to be untracked."""
        if self.records.get(key) is record:
            del self.records[key]
            if self._on_collect is not None and record.kind is MemoryKind.DEVICE:
                self._on_collect(key, record)
            if self._on_host_freed is not None and record.registered:
                self._on_host_freed(key, record)
            self.uncount(record)
            self._unpin(record)
            self._on_forget(key)

    def _drop(self, record: StorageRecord) -> None:
        self.uncount(record)
        self._unpin(record)
        if record.finalizer is not None:
            record.finalizer.detach()

    def _unpin(self, record: StorageRecord) -> None:
        """A host buffer is gone: registered memory is unpinned, a caching-allocator block is cached."""
        self.pinned_bytes -= record.pinned_bytes
        if record.pinned_bytes and not record.registered:
            self.cached_pinned[record.pinned_bytes] += 1
