"""The parts of one simulated accelerator that its components share: streams, checks and clock.

:class:`SimMachine` owns the memory registry, the race checker, the caching allocator, the stream scheduler and
the virtual clock of one :class:`~swap_core.sim.SimBackend`, and the rules every component applies through them:
when the random schedule may run queued work (:meth:`SimMachine.tick`), which stream is current and what an
allocation or compute op on it must run first, which accesses count as writes of a storage, and when the
simulator's own tensor ops are left unchecked. The components (device memory, copies, host buffers) and the
backend's face call these rules; none keeps a stream, check or clock of its own.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator
from typing import Protocol

import torch

from swap_core.backends.protocol import Event, Stream
from swap_core.errors import SimRaceError, SimUseAfterFreeError

from .caching_allocator import CachingAllocator
from .checks import ComputeCheckMode, ComputeOpChecker
from .memory import MemoryKind, MemoryRegistry, StorageRecord, storage_key, storage_too_small
from .race_checker import HOST_AGENT, AccessRequest, OnRace, RaceChecker
from .streams import QueuedCopy, SimEvent, SimStream, StreamScheduler
from .timing import LinkModel, TimedComputeMode, VirtualClock

__all__ = ["SimMachine", "SimSettings"]


class SimSettings(Protocol):
    """What the simulated device is set to do (:class:`~swap_core.sim.SimBackend`'s arguments, read at each call)."""

    poison: bool
    pinned_memory: bool
    exact_pinning: bool
    max_registration_bytes: int
    device_memory: int | None


class SimMachine:
    """Streams, checks and clock of one simulated accelerator, shared by its components.

    Args:
        owner: the backend whose streams and events these are (named in the errors of foreign ones).
        device: the device of the tensors that stand for device and host memory (CPU, or meta for shapes only).
        random_seed: seed of the random schedule, or ``None`` when queued work runs only when forced.
        sync: each queued op runs at once.
        on_race: what the race checker does at a race, or ``None`` for no checks.
        timing: the link model of the virtual clock, or ``None`` for none.
        caching_allocator: keep freed device blocks for stream-ordered reuse.
    """

    def __init__(
        self,
        owner: object,
        device: torch.device,
        *,
        random_seed: int | None,
        sync: bool,
        on_race: OnRace | None,
        timing: LinkModel | None,
        caching_allocator: bool,
    ) -> None:
        self.device = device
        """The device of the tensors that stand for device and host memory."""
        self._owner_name = type(owner).__name__
        self.race_checker = RaceChecker(on_race) if on_race is not None else None
        self.allocator = (
            CachingAllocator(self.race_checker.copy_history if self.race_checker is not None else None)
            if caching_allocator
            else None
        )
        self.registry = MemoryRegistry(
            self._forget_history,
            self._storage_collected if self.allocator is not None else None,
            self._host_buffer_freed if self.race_checker is not None else None,
        )
        self.scheduler = StreamScheduler(self.execute_copy)
        self.sync = sync
        self.rng = random.Random(random_seed) if random_seed is not None else None
        self.clock = VirtualClock(timing) if timing is not None else None
        self.warned: set[str] = set()
        """The warnings given once, by key."""
        self.op_checker = (
            ComputeOpChecker(self.registry, self.race_checker, self.tick, self.issue_on_current, self.host_reads)
            if self.race_checker is not None
            else None
        )
        self._deferred_race: SimRaceError | None = None
        """A race found where it cannot be raised (a garbage-collection callback): raised by the next call."""
        self._thread = threading.local()
        """``stream``: the thread's current stream, when ``current()`` set one (else the compute stream)."""
        self._active_mode: ComputeCheckMode | None = None
        self._timed_mode: TimedComputeMode | None = None

    # -- the schedule ------------------------------------------------------------
    def tick(self) -> None:
        """In random mode, maybe run some queued work now: any point is a legal time for it to run. First, raise a
        race found where it could not be raised (see :meth:`_host_buffer_freed`)."""
        deferred = self._deferred_race
        if deferred is not None:
            self._deferred_race = None
            raise deferred
        if self.rng is not None:
            self.scheduler.run_random(self.rng)

    @property
    def ticks_on_every_call(self) -> bool:
        """Whether :meth:`tick` can do anything now (the random schedule, or a race waiting to be raised)."""
        return self.rng is not None or self._deferred_race is not None

    # -- the current stream ------------------------------------------------------
    @contextlib.contextmanager
    def current(self, stream: SimStream) -> Iterator[None]:
        """Make ``stream`` the calling thread's current stream for the block."""
        previous = getattr(self._thread, "stream", None)
        self._thread.stream = stream
        try:
            yield
        finally:
            self._thread.stream = previous

    def current_stream(self) -> SimStream:
        """The calling thread's current stream: the compute stream unless :meth:`current` set another."""
        stream: SimStream | None = getattr(self._thread, "stream", None)
        return stream if stream is not None else self.scheduler.compute

    def stream_for_allocation(self) -> SimStream:
        """The current stream, about to allocate: an allocation is stream-ordered, so its queued work runs first
        (then blocks it freed are free to it, as a real allocator hands a stream its own freed blocks at once)."""
        self.issue_on_current()
        return self.current_stream()

    def issue_on_current(self) -> str:
        """A compute op is about to run on the current stream: a copy stream's queued work runs first (in order)."""
        stream = self.current_stream()
        if stream.queue:
            self.scheduler.drain(stream)
        return stream.name

    def block_stream(self, record: StorageRecord) -> SimStream:
        """The stream a device storage's bytes belong to (and are freed on)."""
        return record.stream if record.stream is not None else self.scheduler.compute

    def own_stream(self, stream: Stream) -> SimStream:
        """``stream`` as one of this machine's streams; a foreign one is refused."""
        scheduler = self.scheduler
        if isinstance(stream, SimStream) and (stream is scheduler.compute or stream in scheduler.copy_streams):
            return stream
        raise ValueError(f"{stream!r} is not a stream of this {self._owner_name}")

    def own_event(self, event: Event) -> SimEvent:
        """``event`` as one of this machine's events; a foreign one is refused."""
        if isinstance(event, SimEvent) and event.owner is self:
            return event
        raise ValueError(f"{event!r} is not an event of this {self._owner_name}")

    # -- accesses ----------------------------------------------------------------
    def stream_writes_storage(self, stream: SimStream, tensor: torch.Tensor, nbytes: int, op: str) -> None:
        """Allocation and freeing are writes of the whole storage by the stream the memory belongs to."""
        if self.race_checker is not None and nbytes > 0:
            request = AccessRequest(storage_key(tensor), MemoryKind.DEVICE.value, 0, nbytes, True)
            self.race_checker.access(stream.name, [request], op)

    def host_reads(self, stream_name: str) -> None:
        """The host read a value of device memory (``.item()``): it waited for ``stream_name``'s work so far."""
        assert self.race_checker is not None
        self.race_checker.host_waits_for(stream_name)
        if self.clock is not None:
            self.clock.host_waits(self.clock.free_at(stream_name))

    def execute_copy(self, op: QueuedCopy) -> None:
        """Run a copy now; one whose storage was released before it ran is refused."""
        for tensor, role in ((op.dst, "destination"), (op.src, "source")):
            if storage_too_small(tensor):
                raise SimUseAfterFreeError(
                    f"A {op.direction} copy ran after the storage of its {role} was released "
                    "(release_storage before the copy stream finished with it); the copy is dropped"
                )
        if self._active_mode is None and self._timed_mode is None:
            op.dst.copy_(op.src)
        else:
            with self.untracked():
                op.dst.copy_(op.src)

    # -- events (SimEvent reports here) ------------------------------------------
    def record_event(self, stream: SimStream) -> SimEvent:
        """An event at the current end of ``stream``, stamped with the host clock and, on the virtual clock, with
        the stream's end (or now, if it is idle)."""
        snapshot = self.race_checker.snapshot(stream.name) if self.race_checker is not None else None
        event = SimEvent(self, stream, stream.enqueued, snapshot, time.perf_counter())
        clock = self.clock
        if clock is not None:
            event.modeled_at = max(clock.host, clock.free_at(stream.name))
        return event

    def query_event(self, event: SimEvent) -> bool:
        """``event.query()``: done when its stream ran up to it; the host is then ordered after it."""
        self.tick()
        if not event.done:
            return False
        if self.race_checker is not None and event.snapshot is not None:
            self.race_checker.host_waits(event.snapshot)
        return True

    def synchronize_event(self, event: SimEvent) -> None:
        """``event.synchronize()``: runs its stream up to it; the host waits for it."""
        self.tick()
        self.scheduler.force(event.stream, event.position)
        if self.clock is not None and event.modeled_at is not None:
            self.clock.host_waits(event.modeled_at)
        if self.race_checker is not None and event.snapshot is not None:
            self.race_checker.host_waits(event.snapshot)

    # -- the program's ops -------------------------------------------------------
    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        """The simulator's own tensor ops (fills, copies) are not compute ops of the program."""
        with contextlib.ExitStack() as stack:
            for mode in (self._active_mode, self._timed_mode):
                if mode is not None:
                    stack.enter_context(mode.paused())
            yield

    def scope(self, *, timed: bool) -> contextlib.AbstractContextManager[None]:
        """Check (with checks on) and, when ``timed``, time every op of the program inside; a no-op when neither
        applies."""
        if self.op_checker is None and (self.clock is None or not timed):
            return contextlib.nullcontext()
        return self._checked_scope(timed=timed)

    @contextlib.contextmanager
    def _checked_scope(self, *, timed: bool) -> Iterator[None]:
        if self._active_mode is not None or self._timed_mode is not None:
            yield
            return
        check = ComputeCheckMode(self.op_checker) if self.op_checker is not None else None
        clock = self.clock if timed else None
        timed_mode = TimedComputeMode(clock, lambda: self.current_stream().name) if clock is not None else None
        self._active_mode, self._timed_mode = check, timed_mode
        try:
            with contextlib.ExitStack() as modes:
                for mode in (timed_mode, check):  # the checks innermost: an op they refuse takes no time
                    if mode is not None:
                        modes.enter_context(mode)
                yield
        finally:
            self._active_mode, self._timed_mode = None, None

    # -- the registry's callbacks -------------------------------------------------
    def _host_buffer_freed(self, key: int, record: StorageRecord) -> None:
        """The program let go of a registered host buffer (its last tensor was collected): on a device the
        backend unregisters it now, and a copy still in flight would write or read unmapped pages. Checked as a
        host write of the whole buffer; reported (in the races, and raised by the next call of this backend
        when ``on_race="raise"``), since a garbage-collection callback cannot raise."""
        assert self.race_checker is not None
        request = AccessRequest(key, MemoryKind.HOST.value, 0, record.pinned_bytes, True)
        try:
            self.race_checker.access(HOST_AGENT, [request], "free of a registered host buffer")
        except SimRaceError as race:
            # Without its traceback: a collection runs inside whatever code allocated, and those frames (and the
            # tensors they hold) would live as long as the error waits to be raised.
            self._deferred_race = race.with_traceback(None)

    def _storage_collected(self, key: int, record: StorageRecord) -> None:
        """A device tensor was garbage collected: its block (if it still held one) goes to its stream's cache."""
        assert self.allocator is not None
        self.allocator.storage_collected(key, record.counted_bytes, self.block_stream(record).name)

    def _forget_history(self, key: int) -> None:
        if self.race_checker is not None:
            self.race_checker.forget(key)
