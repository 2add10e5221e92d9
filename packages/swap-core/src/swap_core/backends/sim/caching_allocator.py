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
* **Streams.** A block belongs to the stream that was current when it was allocated, and goes back to that
  stream's pool when freed: an allocation takes cached blocks of its own stream only (another stream's
  cached blocks are never handed to it; memory is reserved instead), as CUDA's and the NPU's allocators do.
* **Stream ordering (record_stream), without blocking the host.** A block freed on its stream can be reused
  by the next allocation on that stream at once: both are issued in that stream's order. A block freed
  with ``release_storage(t, in_use_on=stream)`` is in use by the work already issued to ``stream``; it is
  handed out again only once that work has *completed, as an event query sees it*: the stream-ordered
  release has run (lazy and random schedules run it only when something forces the stream), and with a
  virtual clock its modeled time has passed on the host's clock. Until then an allocation passes it by
  and new memory is reserved (``memory_reserved()`` grows); the allocator never blocks the host or forces
  a stream. CUDA's allocator does the same: it polls the events of ``record_stream`` and takes a new block
  while they are pending. A restore of a storage whose own release is still pending takes new memory too;
  the pending copies keep reading the old bytes.
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
    stream: str
    """The stream the block was allocated on: only allocations on that stream take it."""
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
        self._unbound: dict[_Pool, dict[int, CachedBlock]] = {}
        """Cached blocks whose storage is gone, by stream and size, oldest first: what a new allocation takes first."""
        self._bound: dict[_Pool, dict[int, CachedBlock]] = {}
        """Cached blocks whose storage (a released tensor's) is alive, by stream and size, oldest first."""
        self._by_storage: dict[int, CachedBlock] = {}
        """The bound blocks by storage key: a restore of that storage takes its own block back."""
        self._copy_history = copy_history
        self._ids = itertools.count(1)
        self.cached_bytes = 0
        """Bytes of the blocks in the cache (freed, stream-ordered frees still pending included)."""
        self.peak_reserved_bytes = 0

    def free(self, storage_key: int, nbytes: int, stream: str, *, release: QueuedRelease | None = None) -> CachedBlock:
        """A live storage's block goes back to ``stream``'s pool (``release``: behind that stream-ordered free)."""
        block = CachedBlock(nbytes, stream, -next(self._ids), storage_key, release)
        self._bound.setdefault((stream, nbytes), {})[block.block_id] = block
        self._by_storage[storage_key] = block
        self.cached_bytes += nbytes
        return block

    def storage_collected(self, storage_key: int, counted_bytes: int, stream: str) -> None:
        """A storage was garbage collected: its history moves to its block; a live allocation's block is freed."""
        block = self._by_storage.get(storage_key)
        if block is not None:
            self.unbind(block)
        if counted_bytes > 0:
            self.cached_bytes += counted_bytes
            self._add_unbound(CachedBlock(counted_bytes, stream, -next(self._ids), storage_key))

    def bound_block(self, storage_key: int) -> CachedBlock | None:
        """The cached block a live released storage still owns (its own block to restore into), if any."""
        return self._by_storage.get(storage_key)

    def unbind(self, block: CachedBlock) -> None:
        """``block``'s storage no longer maps it (collected, or given new memory while the block's release is
        pending): the block stays cached on its own, its history under its own id."""
        if self._by_storage.get(block.history_key) is block:
            del self._by_storage[block.history_key]
        del self._bound[(block.stream, block.nbytes)][block.block_id]
        self._add_unbound(block)

    def take(
        self, nbytes: int, storage_key: int, stream: str, *, restoring: bool, usable: Callable[[CachedBlock], bool]
    ) -> CachedBlock | None:
        """A cached block of ``nbytes`` on ``stream`` for an allocation into the storage ``storage_key``, or ``None``
        (new memory is reserved): the storage's own block first, else the oldest block whose storage is gone,
        else (not when ``restoring``) the oldest block of a released storage that is still alive. A block that is
        not ``usable`` (its stream-ordered release has not completed) is passed by.

        A restore does not take another released storage's block: that one would then take a third's on its
        own restore, and so on every step. Swap's flows restore the storages they released, so they always
        find their own blocks.
        """
        pool = (stream, nbytes)
        block = self._by_storage.get(storage_key)
        if block is None or block.nbytes != nbytes or block.stream != stream or not usable(block):
            block = _oldest(self._unbound.get(pool), usable)
            if block is None and not restoring:
                block = _oldest(self._bound.get(pool), usable)
            if block is None:
                return None
        if self._by_storage.get(block.history_key) is block:
            del self._by_storage[block.history_key]
        for pools in (self._bound, self._unbound):
            pools.get(pool, {}).pop(block.block_id, None)
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

    def _add_unbound(self, block: CachedBlock) -> None:
        """The block's storage is gone: its history stays under the block's own id, its bytes are unmapped."""
        if self._copy_history is not None:
            self._copy_history(block.history_key, block.block_id)
        block.history_key = block.block_id
        block.retained = None
        block.storage = None
        self._unbound.setdefault((block.stream, block.nbytes), {})[block.block_id] = block


_Pool = tuple[str, int]
"""A pool of cached blocks: the stream they belong to and their size."""


def _oldest(blocks: dict[int, CachedBlock] | None, usable: Callable[[CachedBlock], bool]) -> CachedBlock | None:
    """The oldest usable block (blocks whose release is pending are few: the last ones a step released)."""
    if not blocks:
        return None
    return next((block for block in blocks.values() if usable(block)), None)
