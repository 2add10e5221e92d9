"""The simulator's device memory: allocation, stream-ordered release and restore, capacity and memory stats.

:class:`SimDeviceMemory` allocates poisoned device storages written by the current stream, frees them on the
stream they belong to (or stream-ordered behind another stream's work, as ``record_stream`` does), restores
released storages, keeps freed blocks in the :mod:`~swap_core.backends.sim.caching_allocator` for stream-ordered
reuse, refuses allocations beyond the simulated capacity, and counts what ``torch.cuda.memory_allocated`` and
``memory_reserved`` would. :class:`~swap_core.sim.SimBackend` delegates its device-memory methods here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from swap_core.backends.dense_storage import spans_whole_storage
from swap_core.backends.protocol import Stream
from swap_core.errors import SimOutOfMemoryError

from .caching_allocator import CachedBlock
from .machine import SimMachine, SimSettings
from .memory import HOST_KINDS, MemoryKind, StorageRecord, poison_storage, storage_key
from .race_checker import AccessRequest
from .streams import QueuedRelease, SimStream

__all__ = ["SimDeviceMemory"]


class SimDeviceMemory:
    """Device memory of one :class:`~swap_core.sim.SimBackend` (see its methods of the same names)."""

    def __init__(self, machine: SimMachine, settings: SimSettings) -> None:
        self._machine, self._settings = machine, settings
        self._registry, self._allocator = machine.registry, machine.allocator

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """See :meth:`SimBackend.empty`."""
        machine = self._machine
        machine.tick()
        self._check_capacity(math.prod(shape) * dtype.itemsize, "empty")
        with machine.untracked():
            tensor = torch.empty(tuple(shape), dtype=dtype, device=machine.device)
            if self._settings.poison:
                poison_storage(tensor)
        record = self._registry.register(tensor, MemoryKind.DEVICE)
        nbytes = tensor.untyped_storage().nbytes()
        stream = machine.stream_for_allocation()
        record.stream = stream
        block = self._take_block(nbytes, record, storage_key(tensor), stream, restoring=False)
        self._registry.count(record, nbytes)
        self._note_reserved()
        op = "empty (allocation)" if block is None else "empty (reuses a cached block)"
        machine.stream_writes_storage(stream, tensor, nbytes, op)
        return tensor

    def release_storage(self, tensor: torch.Tensor, in_use_on: Stream | None) -> None:
        """See :meth:`SimBackend.release_storage`."""
        machine = self._machine
        machine.tick()
        record = self.device_record(tensor, "release_storage")
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes == 0 or record.retained or record.pending_release is not None:
            return
        if in_use_on is not None and machine.own_stream(in_use_on) is not machine.block_stream(record):
            self._release_after(tensor, record, nbytes, machine.own_stream(in_use_on))
            return
        self._free_storage(tensor, record, nbytes)

    def free_when_done(self, tensor: torch.Tensor, allocated_on: Stream, in_use_on: Stream) -> None:
        """See :meth:`SimBackend.free_when_done`. The block of torch-allocated ``tensor`` goes back to
        ``allocated_on``'s pool once dropped, and its next allocation there writes the whole storage: at once when
        ``in_use_on`` is that stream, else only after ``in_use_on``'s work so far (``record_stream``), so the write
        is modeled at the end of ``in_use_on``, checked by the race checker against every earlier access (a read
        not ordered before it, the update's read of a gradient under another stream, is reported)."""
        machine = self._machine
        machine.own_stream(allocated_on)
        if machine.race_checker is not None:
            nbytes = tensor.untyped_storage().nbytes()
            machine.stream_writes_storage(machine.own_stream(in_use_on), tensor, nbytes, "reuse of a freed block")

    def _release_after(self, tensor: torch.Tensor, record: StorageRecord, nbytes: int, stream: SimStream) -> None:
        """``release_storage(tensor, in_use_on=stream)``: queued on ``stream`` behind the work that reads it."""
        machine = self._machine
        checker, clock = machine.race_checker, machine.clock
        self._registry.uncount(record)
        if checker is not None:
            request = AccessRequest(storage_key(tensor), MemoryKind.DEVICE.value, 0, nbytes, True)
            checker.access(stream.name, [request], "release_storage")
        cached: list[CachedBlock] = []
        op = QueuedRelease(
            lambda: self._unmap(tensor, record, cached[0] if cached else None),
            stream,
            stream.enqueued + 1,
            checker.snapshot(stream.name) if checker is not None else None,
            clock.free_at(stream.name) if clock is not None else None,
        )
        if self._allocator is not None:
            block_stream = machine.block_stream(record).name
            cached.append(self._allocator.free(storage_key(tensor), nbytes, block_stream, release=op))
        record.pending_release = op
        machine.scheduler.enqueue(stream, op)
        if machine.sync:
            machine.scheduler.drain(stream)

    def _free_storage(self, tensor: torch.Tensor, record: StorageRecord, nbytes: int) -> None:
        """Free a storage on its own stream: uncounted, its block cached (see :meth:`_unmap`); now, or behind the
        work queued on that stream when it is a copy stream made current (its waits have not run yet)."""
        stream = self._machine.block_stream(record)
        if stream.queue:
            self._release_after(tensor, record, nbytes, stream)
            return
        self._machine.stream_writes_storage(stream, tensor, nbytes, "release_storage")
        self._registry.uncount(record)
        key = storage_key(tensor)
        block = self._allocator.free(key, nbytes, stream.name) if self._allocator is not None else None
        self._unmap(tensor, record, block)

    def _unmap(self, tensor: torch.Tensor, record: StorageRecord, block: CachedBlock | None) -> None:
        """Give the storage's bytes up: shrunk with checks on (a late access is caught), else kept mapped as its
        cached ``block`` so that restoring the storage takes them back without page faults.

        Kept bytes are poisoned now (a real allocator hands them to the next user), so a copy that still reads
        them because a wait is missing yields NaN instead of a lucky match.
        """
        if block is not None and block.in_cache and self._machine.race_checker is None:
            record.retained = True
            block.retained, block.storage = record, tensor.untyped_storage()
            if self._settings.poison:
                with self._machine.untracked():
                    poison_storage(tensor)
            return
        with self._machine.untracked():
            tensor.untyped_storage().resize_(0)

    def _take_block(
        self, nbytes: int, record: StorageRecord, key: int, stream: SimStream, *, restoring: bool
    ) -> CachedBlock | None:
        """A cached block of ``stream`` for a new allocation of ``record``'s storage, ordered after the block's last
        free; its history passes to the new user. ``None``: new memory is reserved."""
        if self._allocator is None:
            return None
        block = self._allocator.take(
            nbytes, key, stream.name, restoring=restoring, usable=lambda cached: self._released(cached, stream)
        )
        if block is None:
            return None
        release, checker = block.release, self._machine.race_checker
        if release is not None and checker is not None and release.snapshot is not None:
            checker.host_waits(release.snapshot)  # the allocator saw the release complete
        owner = block.retained
        if owner is not None and owner is not record:  # another storage still maps the bytes: unmap them there
            assert block.storage is not None
            owner.retained = False
            with self._machine.untracked():
                block.storage.resize_(0)
        block.retained, block.storage = None, None
        self._allocator.inherit_history(block, key)
        return block

    def _released(self, block: CachedBlock, stream: SimStream) -> bool:
        """Whether ``block`` is free for an allocation on ``stream``: freed on its own stream, or its stream-ordered
        release has completed as an event query sees it now (the queue ran it, and on the virtual clock its
        time has passed on the host's; a release queued on ``stream`` itself is ordered before the allocation)."""
        release, clock = block.release, self._machine.clock
        if release is None:
            return True
        if release.stream.completed < release.position:
            return False
        if release.stream is stream or clock is None or release.modeled_at is None:
            return True
        return release.modeled_at <= clock.host

    def _detach_pending_release(self, tensor: torch.Tensor, record: StorageRecord) -> None:
        """A storage whose stream-ordered release is still queued is allocated again: it takes new bytes, and the
        queued work keeps its old ones (a real allocator gives a new block; the old one is freed behind the work).

        The queued copies that touch the storage are pointed at a copy of its bytes, and the queued release then
        frees nothing of the storage.
        """
        pending = record.pending_release
        assert pending is not None
        pending.free = None
        key = storage_key(tensor)
        storage = tensor.untyped_storage()
        device = self._machine.device
        with self._machine.untracked():
            old_bytes = torch.empty(storage.nbytes(), dtype=torch.uint8, device=device)
            old_bytes.copy_(torch.empty(0, dtype=torch.uint8, device=device).set_(storage))
            self._machine.scheduler.redirect(key, old_bytes.untyped_storage())
            storage.resize_(0)
        record.pending_release = None

    def restore_storage(self, tensor: torch.Tensor) -> None:
        """See :meth:`SimBackend.restore_storage`."""
        self._machine.tick()
        if not spans_whole_storage(tensor):
            raise ValueError(
                "restore_storage needs a dense tensor at storage offset 0, got shape "
                f"{tuple(tensor.shape)}, stride {tensor.stride()}, offset {tensor.storage_offset()}"
            )
        record = self.device_record(tensor, "restore_storage")
        nbytes = tensor.numel() * tensor.element_size()
        held = tensor.untyped_storage().nbytes()
        if record.pending_release is None and not record.retained:
            if held == nbytes:
                return
            if held != 0:
                raise ValueError(
                    f"restore_storage expects a storage released by release_storage; this one holds {held} bytes "
                    f"and the tensor needs {nbytes}"
                )
        self._check_capacity(nbytes, "restore_storage")
        stream = self._machine.stream_for_allocation()
        self._give_up_unavailable_block(tensor, record, stream)
        record.pending_release = None
        record.stream = stream
        block = self._take_block(nbytes, record, storage_key(tensor), stream, restoring=True)
        self._map_again(tensor, record, block, stream, nbytes)
        self._registry.count(record, nbytes)
        self._note_reserved()

    def _give_up_unavailable_block(self, tensor: torch.Tensor, record: StorageRecord, stream: SimStream) -> None:
        """Before a restore on ``stream``: when the storage's own cached block is not to be had now, it takes new
        bytes, and the old ones stay with the work still using them."""
        key = storage_key(tensor)
        own = self._allocator.bound_block(key) if self._allocator is not None else None
        if own is not None and own.stream == stream.name and self._released(own, stream):
            return
        pending = record.pending_release
        if pending is not None and pending.stream.completed < pending.position:
            self._detach_pending_release(tensor, record)
        if own is not None:
            self._allocator.unbind(own)  # type: ignore[union-attr]  # own comes from the allocator
        if self._machine.race_checker is not None:
            self._machine.race_checker.forget(key)  # new bytes; the old ones' history stays with their block
        record.retained = False

    def _map_again(
        self, tensor: torch.Tensor, record: StorageRecord, block: CachedBlock | None, stream: SimStream, nbytes: int
    ) -> None:
        """A restored storage takes its bytes (poisoned): its own block still mapped, or fresh ones written by
        ``stream``."""
        machine = self._machine
        if record.retained:  # the cache gave the storage its own block back, still mapped
            record.retained = False
            if self._settings.poison:
                with machine.untracked():
                    poison_storage(tensor)
            return
        reused = block is not None and block.history_key != storage_key(tensor)
        op = "restore_storage (reuses a cached block)" if reused else "restore_storage"
        machine.stream_writes_storage(stream, tensor, nbytes, op)
        storage = tensor.untyped_storage()
        with machine.untracked():
            if storage.nbytes() != 0:  # the release ran with checks off: the bytes stayed mapped, now in use
                storage.resize_(0)
            storage.resize_(nbytes)
            if self._settings.poison:
                poison_storage(tensor)

    def available_device_bytes(self) -> int | None:
        """See :meth:`SimBackend.available_device_bytes`."""
        capacity = self._settings.device_memory
        if capacity is None:
            return None
        return max(capacity - self._registry.allocated_bytes, 0)

    def _check_capacity(self, nbytes: int, what: str) -> None:
        """Refuse an allocation beyond ``device_memory``, as a real device does; give the cached blocks back first
        when only they stand in the way."""
        capacity = self._settings.device_memory
        if capacity is None:
            return
        allocated = self._registry.allocated_bytes
        if allocated + nbytes > capacity:
            raise SimOutOfMemoryError(
                f"Simulated device out of memory in {what}: tried to allocate {nbytes} bytes with {allocated} of "
                f"{capacity} bytes allocated (SimBackend(device_memory={capacity}))"
            )
        if self.memory_reserved() + nbytes > capacity:
            self.empty_cache()

    def memory_reserved(self) -> int:
        """See :meth:`SimBackend.memory_reserved`."""
        cached = self._allocator.cached_bytes if self._allocator is not None else 0
        return self._registry.allocated_bytes + cached

    def max_memory_reserved(self) -> int:
        """See :meth:`SimBackend.max_memory_reserved`."""
        if self._allocator is None:
            return self._registry.peak_bytes
        return self._allocator.peak_reserved_bytes

    def empty_cache(self) -> None:
        """See :meth:`SimBackend.empty_cache`."""
        self._machine.tick()
        if self._allocator is None:
            return
        for block in self._allocator.drop_all():
            owner = block.retained
            if owner is not None and block.storage is not None:
                owner.retained = False
                with self._machine.untracked():
                    block.storage.resize_(0)

    def reset_peak(self) -> None:
        """Start the allocated and reserved peaks afresh from what is held now."""
        if self._allocator is not None:
            self._allocator.reset_peak(self._registry.allocated_bytes)

    def device_record(self, tensor: torch.Tensor, what: str) -> StorageRecord:
        """The registry's record of a device tensor (registered now if it was plain); host memory is refused."""
        device = self._machine.device
        if tensor.device != device:
            raise ValueError(f"{what} of SimBackend needs a tensor on {device}, got one on {tensor.device}")
        record = self._registry.lookup(storage_key(tensor))
        if record is None:
            return self._registry.register(tensor, MemoryKind.DEVICE)
        if record.kind in HOST_KINDS:
            raise ValueError(f"{what} manages device memory, but this tensor is host memory from empty_host()")
        return record

    def _note_reserved(self) -> None:
        if self._allocator is not None:
            self._allocator.note_reserved(self._registry.allocated_bytes)
