"""The simulator's caching allocator: freed device blocks are kept and reused, as CUDA's and the NPU's are.

The contract (what :class:`~swap_core.backends.sim.SimBackend` promises and the tests hold it to):

* **Blocks.** Every device allocation (``empty``, ``restore_storage``) is a block of exactly its bytes,
  whatever its dtype. Freeing it (``release_storage``, or the garbage collection of a tensor from
  ``empty``) keeps the block in the cache; a later allocation of the same byte count takes a cached block
  before new memory is reserved (a ``restore_storage`` takes its storage's own block back, or a block
  whose storage is gone, never another released storage's). ``memory_allocated()`` counts the blocks in
  use, exactly as before; ``memory_reserved()`` counts those plus the cached ones, and ``empty_cache()``
  drops the cached ones.
  (A real allocator rounds to 512 bytes and carves small blocks out of 2 MiB segments: its reserved figure
  is at least the simulator's.)
* **Stream ordering (record_stream).** A block freed on the compute stream can be reused by the next
  allocation at once: both are issued in the compute stream's order. A block freed with
  ``release_storage(t, in_use_on=stream)`` is in use by the work already issued to ``stream``; it is handed
  out again only *after* that work: the allocation that reuses it is ordered after the stream's release
  (the queue is run up to it, the compute stream joins its race-checker clock, and with a virtual clock
  the compute stream waits for its time). CUDA's allocator records an event on each stream of
  ``record_stream`` and reuses the block once those events have completed; the simulator orders the reuse
  after the release instead of skipping the block, so the same blocks are reused in every mode and the
  figures do not depend on the schedule.
* **Premature reuse.** A block freed on the compute stream while another stream may still touch it (a
  missing wait, or a missing ``in_use_on``) is a bug: the reuse is an allocation write of the whole block,
  checked by the race checker against the block's history (every access its earlier users issued), so the
  unordered pair is reported, naming the reuse.
* **Poison.** A reused block is poisoned again when it is handed out, as fresh memory is (with ``poison``).
* **Physical memory.** Blocks are bookkeeping over CPU memory: with race checks on, freed storage is
  really shrunk (so a late access is caught) and a reused block gets new CPU memory. With checks off, a
  block freed by ``release_storage`` keeps its bytes mapped in its storage, and restoring that same storage
  takes them back, so steps do not page-fault their staging in again.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .memory import StorageRecord
from .streams import QueuedRelease

__all__ = ["CachedBlock", "CachingAllocator"]


@dataclass(eq=False, slots=True)
class CachedBlock:
    """A freed block in the cache."""

    nbytes: int
    block_id: int
    """Where the race checker keeps the block's history once its storage is gone (negative: never an address)."""
    history_key: int
    """The race-checker key holding the history of the block's earlier users: its storage, or ``block_id``."""
    release: QueuedRelease | None = None
    """The stream-ordered free (``in_use_on``) a reuse must be ordered after; ``None`` for a compute-stream free."""
    retained: StorageRecord | None = None
    """The record whose storage still maps the block's bytes (checks off), or ``None`` when they are unmapped."""
    storage: torch.UntypedStorage | None = field(default=None, repr=False)
    """That storage, so that handing the block to another allocation can unmap it."""
    in_cache: bool = True
    """Still cached: not taken by an allocation nor dropped by ``empty_cache``."""


class CachingAllocator:
    """Free blocks by exact byte count, and the reserved-byte accounting of the simulator.

    Every operation is O(1) in the number of cached blocks (a step of a per-tensor swap frees and takes
    thousands of blocks of one size).
    """

    def __init__(self, copy_history: Callable[[int, int], None] | None) -> None:
        self._unbound: dict[int, dict[int, CachedBlock]] = {}
        """Cached blocks whose storage is gone, by size, oldest first: what a new allocation takes first."""
        self._bound: dict[int, dict[int, CachedBlock]] = {}
        """Cached blocks whose storage (a released tensor's) is alive, by size, oldest first."""
        self._by_storage: dict[int, CachedBlock] = {}
        """The bound blocks by storage key: a restore of that storage takes its own block back."""
        self._copy_history = copy_history
        self._ids = itertools.count(1)
        self.cached_bytes = 0
        """Bytes of the blocks in the cache (freed, stream-ordered frees still pending included)."""
        self.peak_reserved_bytes = 0

    def free(self, storage_key: int, nbytes: int, *, release: QueuedRelease | None = None) -> CachedBlock:
        """A live storage's block goes back to the cache (``release``: behind that stream's work)."""
        block = CachedBlock(nbytes, -next(self._ids), storage_key, release)
        self._bound.setdefault(nbytes, {})[block.block_id] = block
        self._by_storage[storage_key] = block
        self.cached_bytes += nbytes
        return block

    def storage_collected(self, storage_key: int, counted_bytes: int) -> None:
        """A storage was garbage collected: its history moves to its block; a live allocation's block is freed."""
        block = self._by_storage.pop(storage_key, None)
        if block is not None:
            del self._bound[block.nbytes][block.block_id]
            self._unbind(block)
        if counted_bytes > 0:
            self.cached_bytes += counted_bytes
            self._unbind(CachedBlock(counted_bytes, -next(self._ids), storage_key))

    def take(self, nbytes: int, storage_key: int, *, restoring: bool) -> CachedBlock | None:
        """A cached block of ``nbytes`` for an allocation into the storage ``storage_key``, or ``None`` (new memory
        is reserved): the storage's own block first, else the oldest block whose storage is gone, else (not when
        ``restoring``) the oldest block of a released storage that is still alive.

        A restore does not take another released storage's block: that one would then take a third's on its
        own restore, and so on every step. Swap's flows restore the storages they released, so they always
        find their own blocks.
        """
        block = self._by_storage.get(storage_key)
        if block is None or block.nbytes != nbytes:
            block = _oldest(self._unbound.get(nbytes))
            if block is None and not restoring:
                block = _oldest(self._bound.get(nbytes))
            if block is None:
                return None
        if self._by_storage.get(block.history_key) is block:
            del self._by_storage[block.history_key]
        for pool in (self._bound, self._unbound):
            pool.get(nbytes, {}).pop(block.block_id, None)
        block.in_cache = False
        self.cached_bytes -= nbytes
        return block

    def inherit_history(self, block: CachedBlock, storage_key: int) -> None:
        """The new user's storage starts with the block's history, so a premature reuse is a race."""
        if self._copy_history is not None and block.history_key != storage_key:
            self._copy_history(block.history_key, storage_key)

    def drop_all(self) -> list[CachedBlock]:
        """Empty the cache (``empty_cache``); returns the dropped blocks, whose bytes the caller unmaps."""
        dropped = [
            block for pool in (self._unbound, self._bound) for blocks in pool.values() for block in blocks.values()
        ]
        for block in dropped:
            block.in_cache = False
        self._unbound.clear()
        self._bound.clear()
        self._by_storage.clear()
        self.cached_bytes = 0
        return dropped

    def note_reserved(self, allocated_bytes: int) -> None:
        """Track the peak of reserved bytes after an allocation."""
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, allocated_bytes + self.cached_bytes)

    def reset_peak(self, allocated_bytes: int) -> None:
        self.peak_reserved_bytes = allocated_bytes + self.cached_bytes

    def _unbind(self, block: CachedBlock) -> None:
        """The block's storage is gone: its history stays under the block's own id, its bytes are unmapped."""
        if self._copy_history is not None:
            self._copy_history(block.history_key, block.block_id)
        block.history_key = block.block_id
        block.retained = None
        block.storage = None
        self._unbound.setdefault(block.nbytes, {})[block.block_id] = block


def _oldest(blocks: dict[int, CachedBlock] | None) -> CachedBlock | None:
    return next(iter(blocks.values()), None) if blocks else None
