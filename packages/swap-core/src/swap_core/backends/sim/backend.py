"""The simulated accelerator: the stream model of a real device over CPU memory, made strict.

A CPU-only machine cannot run real streams, yet the swap pipeline's correctness
is all about stream ordering. :class:`SimBackend` keeps the CUDA semantics of the
:mod:`~swap_core.backends.protocol` but makes every ordering mistake observable:
copy streams run as late as allowed (``lazy``) or at seeded random points
(``random``), fresh device memory is NaN-like poison, and a vector-clock race
checker reports unordered accesses when they are issued.
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Literal

import torch

from swap_core.backends.host_memory import HostMemoryMode, available_host_bytes
from swap_core.backends.protocol import Event, Stream
from swap_core.backends.tensor_layout import spans_whole_storage
from swap_core.errors import SimOutOfMemoryError, SimPageableCopyError, SimRaceError, SimUseAfterFreeError
from swap_core.torch_compat import storage_id

from .caching_allocator import CachedBlock, CachingAllocator
from .checks import ComputeCheckMode, ComputeOpChecker
from .copy_stats import CopyStats
from .faults import CopyFault, is_count
from .host_buffers import SimHostBuffers
from .memory import (
    HOST_KINDS,
    MemoryKind,
    MemoryRegistry,
    StorageRecord,
    byte_span,
    poison_storage,
    storage_key,
    storage_too_small,
)
from .race_checker import HOST_AGENT, AccessRequest, OnRace, RaceChecker
from .streams import QueuedCopy, QueuedRelease, QueuedWait, SimEvent, SimStream, StreamScheduler
from .timing import LinkModel, ModeledTimes, TimedComputeMode, VirtualClock

if TYPE_CHECKING:
    from swap_core.backends.protocol import DeviceBackend

__all__ = ["SIM_MODES", "SimBackend", "SimMode"]

SimMode = Literal["lazy", "random", "sync"]
SIM_MODES: tuple[SimMode, ...] = ("lazy", "random", "sync")
_ON_RACE: tuple[OnRace, ...] = ("raise", "record")


class SimBackend:
    """A simulated accelerator whose device memory is CPU memory the simulator tracks.

    Memory classes: storages from :meth:`empty`, :meth:`restore_storage` and
    :meth:`adopt` are *device* memory; storages from :meth:`empty_host` are *host*
    memory (pinned, or pageable with ``pinned_memory=False``); every other CPU
    tensor is *plain* and counts as on the device (so a CPU model's parameters need
    no set-up), but is not race-tracked until it takes part in a copy.

    Races are checked on every copy, event and allocation call. Compute ops are
    checked (races, use of released storage, host/device mixing) only inside
    :meth:`compute_scope` and only with ``check_races=True``: elsewhere, reading a
    released tensor crashes the process as in plain torch.

    Args:
        mode: when copy streams run. ``"lazy"``: only when forced (a compute-stream
            wait on one of their events, ``Event.synchronize``, ``synchronize``);
            ``"random"``: also at seeded random points (every backend call, and every
            checked compute op); ``"sync"``: each queued op runs at once.
        seed: seed of the ``"random"`` schedule; the same seed gives the same schedule.
        check_races: run the race checker and, inside :meth:`compute_scope`, the
            per-op checks (use after free, host/device mixing). Off, nothing
            intercepts ops and :meth:`compute_scope` is a no-op.
        poison: fill fresh device and host memory with 0xFF bytes (NaN for floats).
        pinned_memory: ``False`` simulates a failed pin: :meth:`empty_host` warns once
            and returns pageable memory, whose copies run synchronously.
        on_race: ``"raise"`` a :class:`~swap_core.errors.SimRaceError` at the first
            race, or only ``"record"`` it in :attr:`races`.
        exact_pinning: ``False`` simulates a driver that cannot register memory:
            ``mode="exact"`` host buffers fall back to the caching allocator's
            power-of-two rounding, warning once.
        host_bytes: simulate a host with this much available memory (less the live
            pinned buffers) instead of reading the real host's.
        timing: a :class:`~swap_core.backends.sim.timing.LinkModel` gives every stream a
            virtual timeline (:mod:`~swap_core.backends.sim.timing`): copies last bytes over
            the link, compute ops inside :meth:`compute_scope` bytes over device bandwidth,
            events carry times; read them with :meth:`modeled_times`. Deterministic: the same
            in every mode and on every machine. ``None``: no virtual clock.
        caching_allocator: keep freed device blocks and reuse them, stream-ordered, as a real
            device's allocator does (:mod:`~swap_core.backends.sim.caching_allocator`);
            ``False``: every free gives the bytes back at once and :meth:`memory_reserved` equals
            :meth:`memory_allocated`.
        device_memory: the device's capacity in bytes for what the backend allocates (staging, states on the
            device; parameters, gradients and activations are the program's, not counted): an allocation beyond it
            raises :class:`~swap_core.errors.SimOutOfMemoryError` (a ``torch.OutOfMemoryError``) after the cached
            blocks are given back, as a real allocator does, and :meth:`available_device_bytes` tells what is left.
            ``None``: unlimited, and unknown.
    """

    def __init__(
        self,
        mode: SimMode = "lazy",
        seed: int = 0,
        check_races: bool = True,
        poison: bool = True,
        pinned_memory: bool = True,
        *,
        on_race: OnRace = "raise",
        exact_pinning: bool = True,
        host_bytes: int | None = None,
        timing: LinkModel | None = None,
        caching_allocator: bool = True,
        device_memory: int | None = None,
    ) -> None:
        _check_arguments(mode, seed, on_race, host_bytes, device_memory, timing)
        self.mode: SimMode = mode
        self.seed = seed
        self.check_races = check_races
        self.poison = poison
        self.pinned_memory = pinned_memory
        self.exact_pinning = exact_pinning
        self.host_bytes = host_bytes
        self.device_memory = device_memory
        self.on_race: OnRace = on_race
        self.copy_stats = CopyStats()
        """Copies and bytes per direction since construction or :meth:`reset_copy_stats`."""
        self._race_checker = RaceChecker(on_race) if check_races else None
        self.races: list[str] = self._race_checker.races if self._race_checker is not None else []
        """Every race found so far (with ``on_race="raise"``, the ones raised)."""
        self._allocator = (
            CachingAllocator(self._race_checker.copy_history if self._race_checker is not None else None)
            if caching_allocator
            else None
        )
        self._registry = MemoryRegistry(
            self._forget_history,
            self._storage_collected if self._allocator is not None else None,
            self._host_buffer_freed if self._race_checker is not None else None,
        )
        self._deferred_race: SimRaceError | None = None
        """A race found where it cannot be raised (a garbage-collection callback): raised by the next call."""
        self._scheduler = StreamScheduler(self._execute_copy)
        self._sync = mode == "sync"
        self._rng = random.Random(seed) if mode == "random" else None
        self._thread = threading.local()
        """``stream``: the thread's current stream, when ``stream()`` set one (else the compute stream)."""
        self._op_checker = (
            ComputeOpChecker(self._registry, self._race_checker, self._tick, self._issue_on_current, self._host_reads)
            if self._race_checker is not None
            else None
        )
        self._active_mode: ComputeCheckMode | None = None
        self.timing = timing
        self._clock = VirtualClock(timing) if timing is not None else None
        self._timed_mode: TimedComputeMode | None = None
        self._fault: CopyFault | None = None
        self._warned: set[str] = set()
        self._host = SimHostBuffers(
            self._registry, self.device, self, warned=self._warned, tick=self._tick, untracked=self._untracked
        )

    def __repr__(self) -> str:
        return (
            f"SimBackend(mode={self.mode!r}, seed={self.seed}, check_races={self.check_races}, "
            f"poison={self.poison}, pinned_memory={self.pinned_memory})"
        )

    @property
    def name(self) -> str:
        return "sim"

    @property
    def device(self) -> torch.device:
        """Simulated device memory is CPU memory."""
        return torch.device("cpu")

    # -- memory -------------------------------------------------------------
    def owns(self, tensor: torch.Tensor) -> bool:
        """Any CPU tensor that is not host memory from :meth:`empty_host` is on the simulated device."""
        if tensor.device != self.device:
            return False
        record = self._registry.lookup(storage_key(tensor))
        return record is None or record.kind is MemoryKind.DEVICE

    def adopt(self, tensor: torch.Tensor) -> None:
        """Track a parameter or gradient as device memory (nothing is counted: it was allocated before).

        Without checks nothing would ever look at the registration: return at once (called per gradient per step).
        """
        if self._race_checker is None and self._rng is None:
            return
        self._tick()
        if tensor.device != self.device:
            raise ValueError(
                f"{type(self).__name__} can only adopt tensors on {self.device}, got one on {tensor.device}"
            )
        record = self._registry.lookup(storage_key(tensor))
        if record is None:
            self._registry.register(tensor, MemoryKind.DEVICE)
        elif record.kind in HOST_KINDS:
            raise ValueError("Cannot adopt host memory from empty_host() as device memory")

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Poisoned device memory, written by the current stream: a copy stream filling it must wait for that."""
        self._tick()
        self._check_capacity(math.prod(shape) * dtype.itemsize, "empty")
        with self._untracked():
            tensor = torch.empty(tuple(shape), dtype=dtype, device=self.device)
            if self.poison:
                poison_storage(tensor)
        record = self._registry.register(tensor, MemoryKind.DEVICE)
        nbytes = tensor.untyped_storage().nbytes()
        stream = self._stream_for_allocation()
        record.stream = stream
        block = self._take_block(nbytes, record, storage_key(tensor), stream, restoring=False)
        self._registry.count(record, nbytes)
        self._note_reserved()
        op = "empty (allocation)" if block is None else "empty (reuses a cached block)"
        self._stream_writes_storage(stream, tensor, nbytes, op)
        return tensor

    def empty_host(self, numel: int, dtype: torch.dtype, *, mode: HostMemoryMode = "exact") -> torch.Tensor:
        """A poisoned 1-D host buffer that counts what a real one would pin (:mod:`~swap_core.backends.host_memory`).

        Pageable (copies run synchronously) when pinning is simulated to fail; the caching path, with
        its power-of-two rounding, when exact registration is (``exact_pinning=False``).
        """
        return self._host.empty_host(numel, dtype, mode)

    def pinned_bytes(self, buffer: torch.Tensor) -> int:
        """What a real device would have pinned for ``buffer`` (0 for pageable or device memory)."""
        return self._host.pinned_bytes(buffer)

    def host_pinned_bytes(self) -> int:
        """Pinned host bytes of the process: every live :meth:`empty_host` buffer (rounding included), and the blocks
        torch's caching pinned allocator keeps after their ``host_memory="caching"`` buffers were freed (as
        ``torch.cuda.host_memory_stats()`` counts them) until :meth:`empty_host_cache`."""
        return self._registry.process_pinned_bytes

    def empty_host_cache(self) -> None:
        """Give the caching pinned allocator's cached blocks back (``torch._C._host_emptyCache()``)."""
        self._registry.empty_host_cache()

    def max_host_pinned_bytes(self) -> int:
        """Peak of :meth:`host_pinned_bytes` since construction or :meth:`reset_peak_memory_stats`."""
        return self._registry.peak_pinned_bytes

    def available_host_bytes(self) -> int | None:
        """The real host's available memory, or ``host_bytes`` less the live pinned buffers when one was given."""
        if self.host_bytes is None:
            return available_host_bytes()
        return self.host_bytes - self.host_pinned_bytes()

    def release_storage(self, tensor: torch.Tensor, *, in_use_on: Stream | None = None) -> None:
        """Free the storage on the stream it was allocated on; that stream must have waited for copies still using it.

        A plain CPU tensor (an optimizer state created by torch) becomes tracked
        device memory here, so that a later use of it inside :meth:`compute_scope`
        raises :class:`~swap_core.errors.SimUseAfterFreeError` instead of crashing.

        ``in_use_on`` (another stream): freed stream-ordered instead, as a caching allocator frees a block
        with ``record_stream``. The bytes leave :meth:`memory_allocated` now; the storage is freed when
        the stream's queue reaches the release (a copy still reading it runs first), and the allocator
        hands the block out again only once that release has completed (see
        :mod:`~swap_core.backends.sim.caching_allocator`).

        Either way the block stays in the :mod:`~swap_core.backends.sim.caching_allocator` (counted by
        :meth:`memory_reserved`) unless ``caching_allocator=False``.
        """
        self._tick()
        record = self._device_record(tensor, "release_storage")
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0 or record.retained or record.pending_release is not None:
            return
        if in_use_on is not None and self._own_stream(in_use_on) is not self._block_stream(record):
            self._release_after(tensor, record, nbytes, self._own_stream(in_use_on))
            return
        self._free_storage(tensor, record, nbytes)

    def _release_after(self, tensor: torch.Tensor, record: StorageRecord, nbytes: int, stream: SimStream) -> None:
        """``release_storage(tensor, in_use_on=stream)``: queued on ``stream`` behind the work that reads it."""
        self._registry.uncount(record)
        if self._race_checker is not None:
            request = AccessRequest(storage_key(tensor), MemoryKind.DEVICE.value, 0, nbytes, True)
            self._race_checker.access(stream.name, [request], "release_storage")
        clock = self._clock
        cached: list[CachedBlock] = []
        op = QueuedRelease(
            lambda: self._unmap(tensor, record, cached[0] if cached else None),
            stream,
            stream.enqueued + 1,
            self._race_checker.snapshot(stream.name) if self._race_checker is not None else None,
            clock.free_at(stream.name) if clock is not None else None,
        )
        if self._allocator is not None:
            block_stream = self._block_stream(record).name
            cached.append(self._allocator.free(storage_key(tensor), nbytes, block_stream, release=op))
        record.pending_release = op
        self._scheduler.enqueue(stream, op)
        if self._sync:
            self._scheduler.drain(stream)

    def _free_storage(self, tensor: torch.Tensor, record: StorageRecord, nbytes: int) -> None:
        """Free a storage on its own stream: uncounted, its block cached (see :meth:`_unmap`); now, or behind the
        work queued on that stream when it is a copy stream made current (its waits have not run yet)."""
        stream = self._block_stream(record)
        if stream.queue:
            self._release_after(tensor, record, nbytes, stream)
            return
        self._stream_writes_storage(stream, tensor, nbytes, "release_storage")
        self._registry.uncount(record)
        key = storage_key(tensor)
        block = self._allocator.free(key, nbytes, stream.name) if self._allocator is not None else None
        self._unmap(tensor, record, block)

    def _block_stream(self, record: StorageRecord) -> SimStream:
        """The stream a device storage's bytes belong to (and are freed on)."""
        return record.stream if record.stream is not None else self._scheduler.compute

    def _unmap(self, tensor: torch.Tensor, record: StorageRecord, block: CachedBlock | None) -> None:
        """Give the storage's bytes up: shrunk with checks on (a late access is caught), else kept mapped as its
        cached ``block`` so that restoring the storage takes them back without page faults.

        Kept bytes are poisoned now (a real allocator hands them to the next user), so a copy that still reads
        them because a wait is missing yields NaN instead of a lucky match.
        """
        if block is not None and block.in_cache and self._race_checker is None:
            record.retained = True
            block.retained, block.storage = record, tensor.untyped_storage()
            if self.poison:
                with self._untracked():
                    poison_storage(tensor)
            return
        with self._untracked():
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
        release = block.release
        if release is not None and self._race_checker is not None and release.snapshot is not None:
            self._race_checker.host_waits(release.snapshot)  # the allocator saw the release complete
        owner = block.retained
        if owner is not None and owner is not record:  # another storage still maps the bytes: unmap them there
            assert block.storage is not None
            owner.retained = False
            with self._untracked():
                block.storage.resize_(0)
        block.retained, block.storage = None, None
        self._allocator.inherit_history(block, key)
        return block

    def _released(self, block: CachedBlock, stream: SimStream) -> bool:
        """Whether ``block`` is free for an allocation on ``stream``: freed on its own stream, or its stream-ordered
        release has completed as an event query sees it now (the queue ran it, and on the virtual clock its
        time has passed on the host's; a release queued on ``stream`` itself is ordered before the allocation)."""
        release = block.release
        if release is None:
            return True
        if release.stream.completed < release.position:
            return False
        if release.stream is stream or self._clock is None or release.modeled_at is None:
            return True
        return release.modeled_at <= self._clock.host

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
        with self._untracked():
            old_bytes = torch.empty(storage.nbytes(), dtype=torch.uint8, device=self.device)
            old_bytes.copy_(torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage))
            self._scheduler.redirect(key, old_bytes.untyped_storage())
            storage.resize_(0)
        record.pending_release = None

    def restore_storage(self, tensor: torch.Tensor) -> None:
        """Re-allocate a released storage (poisoned, counted, written by the current stream): its own cached block
        when the cache still holds it and it is free on this stream, else a cached block of its size whose storage
        is gone, else new memory."""
        self._tick()
        if not spans_whole_storage(tensor):
            raise ValueError(
                "restore_storage needs a dense tensor at storage offset 0, got shape "
                f"{tuple(tensor.shape)}, stride {tensor.stride()}, offset {tensor.storage_offset()}"
            )
        record = self._device_record(tensor, "restore_storage")
        storage = tensor.untyped_storage()
        nbytes = tensor.numel() * tensor.element_size()
        held = storage.nbytes()
        pending = record.pending_release
        if pending is None and not record.retained:
            if held == nbytes:
                return
            if held != 0:
                raise ValueError(
                    f"restore_storage expects a storage released by release_storage; this one holds {held} bytes "
                    f"and the tensor needs {nbytes}"
                )
        self._check_capacity(nbytes, "restore_storage")
        key = storage_key(tensor)
        stream = self._stream_for_allocation()
        own = self._allocator.bound_block(key) if self._allocator is not None else None
        if own is None or own.stream != stream.name or not self._released(own, stream):
            # Its own bytes are not to be had now: new ones, the old ones stay with the work still using them.
            if pending is not None and pending.stream.completed < pending.position:
                self._detach_pending_release(tensor, record)
            if own is not None:
                self._allocator.unbind(own)  # type: ignore[union-attr]  # own comes from the allocator
            if self._race_checker is not None:
                self._race_checker.forget(key)  # new bytes; the old ones' history stays with their block
            record.retained = False
        record.pending_release = None
        record.stream = stream
        block = self._take_block(nbytes, record, key, stream, restoring=True)
        if record.retained:  # the cache gave the storage its own block back, still mapped
            record.retained = False
            if self.poison:
                with self._untracked():
                    poison_storage(tensor)
        else:
            reused = block is not None and block.history_key != key
            op = "restore_storage (reuses a cached block)" if reused else "restore_storage"
            self._stream_writes_storage(stream, tensor, nbytes, op)
            with self._untracked():
                if storage.nbytes() != 0:  # the release ran with checks off: the bytes stayed mapped, now in use
                    storage.resize_(0)
                storage.resize_(nbytes)
                if self.poison:
                    poison_storage(tensor)
        self._registry.count(record, nbytes)
        self._note_reserved()

    def available_device_bytes(self) -> int | None:
        """``device_memory`` less the bytes allocated (cached blocks are given back before an allocation fails), or
        ``None`` without a capacity."""
        if self.device_memory is None:
            return None
        return max(self.device_memory - self._registry.allocated_bytes, 0)

    def _check_capacity(self, nbytes: int, what: str) -> None:
        """Refuse an allocation beyond ``device_memory``, as a real device does; give the cached blocks back first
        when only they stand in the way."""
        capacity = self.device_memory
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

    def memory_allocated(self) -> int:
        """Device bytes from :meth:`empty` and :meth:`restore_storage` still alive."""
        return self._registry.allocated_bytes

    def max_memory_allocated(self) -> int:
        """Peak of :meth:`memory_allocated` since construction or :meth:`reset_peak_memory_stats`."""
        return self._registry.peak_bytes

    def memory_reserved(self) -> int:
        """Device bytes held: allocated plus cached by the caching allocator (freed blocks kept for reuse)."""
        cached = self._allocator.cached_bytes if self._allocator is not None else 0
        return self._registry.allocated_bytes + cached

    def max_memory_reserved(self) -> int:
        """Peak of :meth:`memory_reserved` since construction or :meth:`reset_peak_memory_stats`."""
        if self._allocator is None:
            return self._registry.peak_bytes
        return self._allocator.peak_reserved_bytes

    def empty_cache(self) -> None:
        """Give every cached block back (``torch.cuda.empty_cache``): :meth:`memory_reserved` drops to what is
        allocated. Blocks whose stream-ordered free is still queued go too: they are never handed out again."""
        self._tick()
        if self._allocator is None:
            return
        for block in self._allocator.drop_all():
            owner = block.retained
            if owner is not None and block.storage is not None:
                owner.retained = False
                with self._untracked():
                    block.storage.resize_(0)

    def reset_peak_memory_stats(self) -> None:
        """Start the device (allocated and reserved) and the pinned-host peaks afresh from what is held now."""
        self._registry.reset_peak()
        if self._allocator is not None:
            self._allocator.reset_peak(self._registry.allocated_bytes)

    # -- streams and events --------------------------------------------------
    def compute_stream(self) -> Stream:
        """The calling thread's current stream: the eager compute stream unless :meth:`stream` set another."""
        return self._current_stream()

    @contextlib.contextmanager
    def stream(self, stream: Stream) -> Iterator[None]:
        """Make ``stream`` the calling thread's current stream for the block: compute ops inside ``compute_scope``
        and allocations are then issued to it (a copy stream made current runs its queue up to each such op
        first, so that its work stays in order)."""
        sim_stream = self._own_stream(stream)
        previous = getattr(self._thread, "stream", None)
        self._thread.stream = sim_stream
        try:
            yield
        finally:
            self._thread.stream = previous

    def new_stream(self) -> Stream:
        """A copy stream: a queue that runs when forced (see ``mode``)."""
        stream = self._scheduler.new_stream()
        if self._race_checker is not None:
            self._race_checker.add_agent(stream.name)
        return stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, stream: Stream) -> None:
        """Issue ``dst.copy_(src)`` on ``stream``; it runs at once on the compute stream, in sync mode, or when
        host memory is pageable, and otherwise when the stream is forced.

        Exactly one side must be host memory from :meth:`empty_host`, or both sides
        tracked device memory. A plain CPU tensor facing host memory is the device
        side (and, with checks on, is adopted as device memory from then on); a plain
        CPU tensor facing device memory stands for pageable host memory, which an
        asynchronous copy cannot use.
        """
        # The hot path of sync mode without checks: keep it to lookups, counters and the copy itself.
        if self._rng is not None or self._deferred_race is not None:
            self._tick()
        sim_stream = self._own_stream(stream)
        records = self._registry.records
        dst_record = records.get(storage_id(dst.untyped_storage()))
        src_record = records.get(storage_id(src.untyped_storage()))
        direction = _copy_direction(dst, src, dst_record, src_record, self.device)
        nbytes = dst.numel() * dst.element_size()
        fault = self._fault
        if fault is not None and fault.fires(direction):
            self._fault = None
            raise fault.error(direction, nbytes)
        self.copy_stats.add(direction, nbytes)
        if self._race_checker is not None:
            self._record_copy(sim_stream, direction, dst, dst_record, src, src_record)
        clock = self._clock
        copied_at = clock.issue_transfer(sim_stream.name, direction, nbytes) if clock else 0.0
        op = QueuedCopy(dst, src, direction)
        pageable = (dst_record is not None and dst_record.is_pageable) or (
            src_record is not None and src_record.is_pageable
        )
        if sim_stream.is_compute:
            self._execute_copy(op)
        elif self._sync and not sim_stream.queue:
            sim_stream.enqueued += 1
            sim_stream.completed += 1
            self._execute_copy(op)
        else:
            # A queued copy keeps the memory it touches, not the program's tensors: the program may let go of a
            # registered host buffer while the copy is in flight, and the simulator must see it (see memory.py).
            op.dst, op.src = _detached(dst, dst_record), _detached(src, src_record)
            self._scheduler.enqueue(sim_stream, op)
            if self._sync or pageable:
                self._scheduler.drain(sim_stream)
        if pageable and self._race_checker is not None:
            self._race_checker.host_waits_for(sim_stream.name)
        if pageable and clock is not None:  # a copy from pageable memory blocks the host
            clock.host_waits(copied_at)

    def record_event(self, stream: Stream, *, timing: bool = False) -> Event:
        """An event at the current end of ``stream`` (always complete on the eager compute stream).

        Every event is stamped with the host clock when it completes (see :meth:`elapsed_seconds`);
        ``timing`` changes nothing here.
        """
        self._tick()
        sim_stream = self._own_stream(stream)
        snapshot = self._race_checker.snapshot(sim_stream.name) if self._race_checker is not None else None
        event = SimEvent(self, sim_stream, sim_stream.enqueued, snapshot, time.perf_counter())
        clock = self._clock
        if clock is not None:  # the stream's end, or now if it is idle
            event.modeled_at = max(clock.host, clock.free_at(sim_stream.name))
        return event

    def elapsed_seconds(self, start: Event, end: Event) -> float:
        """Simulated time between two events: host time between their completions (runs their streams up to them).

        An event completes when its stream's queued work before it has run; in ``sync`` mode that is when it
        was recorded, in ``lazy`` and ``random`` mode whenever that work was forced to run. With ``timing``,
        the virtual time between them instead (traces then show the modeled timeline, with its overlap).
        """
        start_event, end_event = self._own_event(start), self._own_event(end)
        if start_event.modeled_at is not None and end_event.modeled_at is not None:
            return end_event.modeled_at - start_event.modeled_at
        start_event.synchronize()
        end_event.synchronize()
        assert start_event.completed_at is not None and end_event.completed_at is not None
        return end_event.completed_at - start_event.completed_at

    def wait_event(self, stream: Stream, event: Event) -> None:
        """A copy stream queues the wait; the eager compute stream runs the event's stream up to it right away."""
        self._tick()
        sim_stream = self._own_stream(stream)
        sim_event = self._own_event(event)
        if self._race_checker is not None and sim_event.snapshot is not None:
            self._race_checker.wait(sim_stream.name, sim_event.snapshot)
        if self._clock is not None and sim_event.modeled_at is not None:
            self._clock.wait(sim_stream.name, sim_event.modeled_at)
        if sim_event.done:
            return
        if sim_stream.is_compute:
            self._scheduler.force(sim_event.stream, sim_event.position)
            return
        self._scheduler.enqueue(sim_stream, QueuedWait(sim_event))
        if self._sync:
            self._scheduler.drain(sim_stream)

    def synchronize(self) -> None:
        """Run every queue to its end; the host is then ordered after all issued work."""
        self._tick()
        self._scheduler.drain_all()
        if self._race_checker is not None:
            self._race_checker.host_waits_all()
        if self._clock is not None:
            self._clock.host_waits(self._clock.latest())

    @property
    def host_is_device(self) -> bool:
        """The simulated device's memory stands for an accelerator's (``CpuBackend``: host memory is the device's)."""
        return False

    def is_capturing(self) -> bool:
        """The simulator captures no graphs."""
        return False

    def compute_scope(self) -> contextlib.AbstractContextManager[None]:
        """Check every op inside (use after free, host/device mixing, races) when ``check_races`` is on, and
        time it on the compute stream's virtual timeline with ``timing``.

        These checks exist only inside the scope and only with checks on; with
        ``check_races=False`` and no ``timing`` this is :func:`contextlib.nullcontext` and no op is
        intercepted. Nested scopes of one backend check and time each op once.
        """
        if self._op_checker is None and self._clock is None:
            return contextlib.nullcontext()
        return self._checked_scope(self._op_checker, timed=True)

    def host_scope(self) -> contextlib.AbstractContextManager[None]:
        """Check every op inside as the host's access to host buffers (and the current stream's to device memory)
        when ``check_races`` is on: a read or write of a host buffer that a copy still in flight writes or reads
        is a race. Nothing is timed, and nothing queued is run: the ops see what the schedule has done so far."""
        if self._op_checker is None:
            return contextlib.nullcontext()
        return self._checked_scope(self._op_checker, timed=False)

    def read_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor.to("cpu")`` of a device tensor: the current stream's queued work runs first, the host waits for
        that stream and, on the virtual clock, for the bytes to cross the link too; the copy is plain memory."""
        self._tick()
        stream = self._issue_on_current()
        if self._race_checker is not None:
            self._race_checker.host_waits_for(stream)
        if self._clock is not None:
            self._clock.host_waits(self._clock.issue_transfer(stream, "d2h", tensor.numel() * tensor.element_size()))
        return tensor.detach().clone()

    def model_compute(self, seconds: float) -> None:
        """Put ``seconds`` of modeled work (a forward and backward) on the compute stream's virtual timeline."""
        if self._clock is None:
            raise ValueError("model_compute needs a virtual clock: SimBackend(timing=LinkModel(...))")
        if not seconds >= 0:
            raise ValueError(f"model_compute needs seconds >= 0, got {seconds!r}")
        self._clock.issue(self._current_stream().name, seconds)

    def model_host_read(self) -> None:
        """The host reads a value the current stream computes (``loss.item()``): on the virtual clock it waits for
        that stream's work so far."""
        if self._clock is None:
            raise ValueError("model_host_read needs a virtual clock: SimBackend(timing=LinkModel(...))")
        self._clock.host_waits(self._clock.free_at(self._current_stream().name))

    def modeled_times(self) -> ModeledTimes | None:
        """Where the virtual clock stands now, or ``None`` without ``timing``."""
        clock = self._clock
        if clock is None:
            return None
        copies = [clock.free_at(stream.name) for stream in self._scheduler.copy_streams]
        compute = clock.free_at(self._current_stream().name)
        return ModeledTimes(clock.host, compute, max(copies, default=0.0), clock.transfers_started)

    def start_transfer_window(self) -> None:
        """From now on, :meth:`modeled_times` notes when the first copy issued starts (``transfers_started``), on the
        copy streams' timelines; nothing without ``timing``."""
        if self._clock is not None:
            self._clock.start_transfer_window()

    # -- simulator extras ------------------------------------------------------
    def fail_copy(self, at: int, direction: str | None = None) -> None:
        """Arm a one-shot fault: the ``at``-th next :meth:`copy` call (0-based; of ``direction`` only, when given)
        raises :class:`~swap_core.errors.SimInjectedFault` before anything is issued."""
        self._fault = CopyFault(at, direction)

    def reset_copy_stats(self) -> None:
        """Zero :attr:`copy_stats` in place (references to it stay valid)."""
        for field in fields(self.copy_stats):
            setattr(self.copy_stats, field.name, 0)

    def pending_ops(self) -> int:
        """Copies and waits issued to copy streams that have not run yet."""
        return self._scheduler.pending()

    def memory_kind(self, tensor: torch.Tensor) -> MemoryKind | None:
        """What ``tensor``'s storage simulates; ``None`` for a plain CPU tensor."""
        record = self._registry.lookup(storage_key(tensor))
        return None if record is None else record.kind

    # -- internals ------------------------------------------------------------
    def _tick(self) -> None:
        """In random mode, maybe run some queued work now: any point is a legal time for it to run. First, raise a
        race found where it could not be raised (see :meth:`_host_buffer_freed`)."""
        deferred = self._deferred_race
        if deferred is not None:
            self._deferred_race = None
            raise deferred
        if self._rng is not None:
            self._scheduler.run_random(self._rng)

    def _host_buffer_freed(self, key: int, record: StorageRecord) -> None:
        """The program let go of a registered host buffer (its last tensor was collected): on a device the
        backend unregisters it now, and a copy still in flight would write or read unmapped pages. Checked as a
        host write of the whole buffer; reported (in :attr:`races`, and raised by the next call of this backend
        when ``on_race="raise"``), since a garbage-collection callback cannot raise."""
        assert self._race_checker is not None
        request = AccessRequest(key, MemoryKind.HOST.value, 0, record.pinned_bytes, True)
        try:
            self._race_checker.access(HOST_AGENT, [request], "free of a registered host buffer")
        except SimRaceError as race:
            # Without its traceback: a collection runs inside whatever code allocated, and those frames (and the
            # tensors they hold) would live as long as the error waits to be raised.
            self._deferred_race = race.with_traceback(None)

    @contextlib.contextmanager
    def _untracked(self) -> Iterator[None]:
        """The simulator's own tensor ops (fills, copies) are not compute ops of the program."""
        with contextlib.ExitStack() as stack:
            for mode in (self._active_mode, self._timed_mode):
                if mode is not None:
                    stack.enter_context(mode.paused())
            yield

    def _execute_copy(self, op: QueuedCopy) -> None:
        for tensor, role in ((op.dst, "destination"), (op.src, "source")):
            if storage_too_small(tensor):
                raise SimUseAfterFreeError(
                    f"A {op.direction} copy ran after the storage of its {role} was released "
                    "(release_storage before the copy stream finished with it); the copy is dropped"
                )
        if self._active_mode is None and self._timed_mode is None:
            op.dst.copy_(op.src)
        else:
            with self._untracked():
                op.dst.copy_(op.src)

    def _record_copy(
        self,
        stream: SimStream,
        direction: str,
        dst: torch.Tensor,
        dst_record: StorageRecord | None,
        src: torch.Tensor,
        src_record: StorageRecord | None,
    ) -> None:
        """Check the copy's accesses; a plain CPU tensor on the device side is adopted so that later ops on it
        are ordered against this copy too (an optimizer state created by torch, copied to host memory)."""
        assert self._race_checker is not None
        requests = []
        for tensor, record, is_write in ((src, src_record, False), (dst, dst_record, True)):
            if tensor.numel() == 0:
                continue
            if record is None:
                record = self._registry.register(tensor, MemoryKind.DEVICE)
            requests.append(AccessRequest(storage_key(tensor), record.kind.value, *byte_span(tensor), is_write))
        self._race_checker.access(stream.name, requests, f"copy {direction}")

    def _stream_writes_storage(self, stream: SimStream, tensor: torch.Tensor, nbytes: int, op: str) -> None:
        """Allocation and freeing are writes of the whole storage by the stream the memory belongs to."""
        if self._race_checker is not None and nbytes > 0:
            request = AccessRequest(storage_key(tensor), MemoryKind.DEVICE.value, 0, nbytes, True)
            self._race_checker.access(stream.name, [request], op)

    def _current_stream(self) -> SimStream:
        stream: SimStream | None = getattr(self._thread, "stream", None)
        return stream if stream is not None else self._scheduler.compute

    def _stream_for_allocation(self) -> SimStream:
        """The current stream, about to allocate: an allocation is stream-ordered, so its queued work runs first
        (then blocks it freed are free to it, as a real allocator hands a stream its own freed blocks at once)."""
        self._issue_on_current()
        return self._current_stream()

    def _issue_on_current(self) -> str:
        """A compute op is about to run on the current stream: a copy stream's queued work runs first (in order)."""
        stream = self._current_stream()
        if stream.queue:
            self._scheduler.drain(stream)
        return stream.name

    def _host_reads(self, stream_name: str) -> None:
        """The host read a value of device memory (``.item()``): it waited for ``stream_name``'s work so far."""
        assert self._race_checker is not None
        self._race_checker.host_waits_for(stream_name)
        if self._clock is not None:
            self._clock.host_waits(self._clock.free_at(stream_name))

    def _device_record(self, tensor: torch.Tensor, what: str) -> StorageRecord:
        if tensor.device != self.device:
            raise ValueError(
                f"{what} of {type(self).__name__} needs a tensor on {self.device}, got one on {tensor.device}"
            )
        record = self._registry.lookup(storage_key(tensor))
        if record is None:
            return self._registry.register(tensor, MemoryKind.DEVICE)
        if record.kind in HOST_KINDS:
            raise ValueError(f"{what} manages device memory, but this tensor is host memory from empty_host()")
        return record

    def _note_reserved(self) -> None:
        if self._allocator is not None:
            self._allocator.note_reserved(self._registry.allocated_bytes)

    def _storage_collected(self, key: int, record: StorageRecord) -> None:
        """A device tensor was garbage collected: its block (if it still held one) goes to its stream's cache."""
        assert self._allocator is not None
        self._allocator.storage_collected(key, record.counted_bytes, self._block_stream(record).name)

    def _forget_history(self, key: int) -> None:
        if self._race_checker is not None:
            self._race_checker.forget(key)

    def _own_stream(self, stream: Stream) -> SimStream:
        scheduler = self._scheduler
        if isinstance(stream, SimStream) and (stream is scheduler.compute or stream in scheduler.copy_streams):
            return stream
        raise ValueError(f"{stream!r} is not a stream of this SimBackend")

    def _own_event(self, event: Event) -> SimEvent:
        if isinstance(event, SimEvent) and event.owner is self:
            return event
        raise ValueError(f"{event!r} is not an event of this SimBackend")

    @contextlib.contextmanager
    def _checked_scope(self, checker: ComputeOpChecker | None, *, timed: bool) -> Iterator[None]:
        if self._active_mode is not None or self._timed_mode is not None:
            yield
            return
        check = ComputeCheckMode(checker) if checker is not None else None
        clock = self._clock if timed else None
        timed_mode = TimedComputeMode(clock, lambda: self._current_stream().name) if clock is not None else None
        self._active_mode, self._timed_mode = check, timed_mode
        try:
            with contextlib.ExitStack() as modes:
                for mode in (timed_mode, check):  # the checks innermost: an op they refuse takes no time
                    if mode is not None:
                        modes.enter_context(mode)
                yield
        finally:
            self._active_mode, self._timed_mode = None, None

    # -- event callbacks (SimEvent delegates here) ---------------------------
    def _query_event(self, event: SimEvent) -> bool:
        self._tick()
        if not event.done:
            return False
        if self._race_checker is not None and event.snapshot is not None:
            self._race_checker.host_waits(event.snapshot)
        return True

    def _synchronize_event(self, event: SimEvent) -> None:
        self._tick()
        self._scheduler.force(event.stream, event.position)
        if self._clock is not None and event.modeled_at is not None:
            self._clock.host_waits(event.modeled_at)
        if self._race_checker is not None and event.snapshot is not None:
            self._race_checker.host_waits(event.snapshot)


def _detached(tensor: torch.Tensor, record: StorageRecord | None) -> torch.Tensor:
    """``tensor`` itself, or for registered host memory the same view of its storage through a tensor of its own
    (which keeps the bytes alive, but not the program's tensor, whose collection frees the buffer)."""
    if record is None or not record.registered:
        return tensor
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


def _copy_direction(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_record: StorageRecord | None,
    src_record: StorageRecord | None,
    device: torch.device,
) -> str:
    """``"h2d"``, ``"d2h"`` or ``"d2d"``; raises for copies a real device could not run asynchronously."""
    if not (dst.device == device and src.device == device):
        raise ValueError(f"SimBackend copies {device} tensors only, got dst on {dst.device} and src on {src.device}")
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(
            f"SimBackend.copy needs matching shapes and dtypes, got dst {tuple(dst.shape)} {dst.dtype} "
            f"and src {tuple(src.shape)} {src.dtype}"
        )
    dst_host = dst_record is not None and dst_record.is_host
    src_host = src_record is not None and src_record.is_host
    if dst_host and src_host:
        raise ValueError(
            "SimBackend.copy moves data between host and device, but dst and src are both host memory "
            "from empty_host(); copy host buffers with Tensor.copy_"
        )
    if src_host:
        return "h2d"
    if dst_host:
        return "d2h"
    if dst_record is None or src_record is None:
        plain = "src" if src_record is None else "dst"
        raise SimPageableCopyError(
            f"SimBackend.copy got a plain CPU tensor as {plain} ({tuple(src.shape)} {src.dtype}) with no host "
            "buffer on the other side: the simulator treats it as pageable host memory, which an asynchronous "
            "copy cannot use. Allocate host buffers with empty_host(); declare device tensors such as parameters "
            "and gradients with adopt()."
        )
    return "d2d"


if TYPE_CHECKING:

    def _conforms_to_protocol(backend: SimBackend) -> DeviceBackend:
        return backend


def _check_arguments(
    mode: object, seed: object, on_race: object, host_bytes: object, device_memory: object, timing: object
) -> None:
    """Refuse :class:`SimBackend`'s arguments that it cannot simulate, naming the value (checked at run time,
    whatever the annotations say)."""
    if mode not in SIM_MODES:
        raise ValueError(f"Invalid simulator mode: {mode!r}; expected one of {SIM_MODES}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"Invalid simulator seed: {seed!r}; expected an int")
    if on_race not in _ON_RACE:
        raise ValueError(f"Invalid on_race: {on_race!r}; expected one of {_ON_RACE}")
    if host_bytes is not None and not is_count(host_bytes):
        raise ValueError(f"Invalid simulated host_bytes: {host_bytes!r}; expected an int >= 0 or None")
    if device_memory is not None and not is_count(device_memory):
        raise ValueError(f"Invalid simulated device_memory: {device_memory!r}; expected an int >= 0 or None")
    if timing is not None and not isinstance(timing, LinkModel):
        raise TypeError(f"SimBackend timing must be a LinkModel or None, got {type(timing).__name__}")
