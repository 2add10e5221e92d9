"""Simulated streams: an eager compute stream and FIFO queues of copies and waits.

The compute stream runs every op the moment Python issues it, so it never holds
queued work. A copy stream is a queue that runs only when something *forces* it:
a wait on one of its events from the compute stream, an event or device
synchronize, or the random scheduler. Queued work therefore runs as late as the
ordering allows (or at a seeded random point), which is what makes a missing wait
visible as a wrong number. An event is just a position in its stream's queue.

Timing is a simulated clock read off the host's: an event completes when its
stream's queue has run up to it, and is stamped with the host clock at that
moment (at record time when nothing was pending), so intervals between events
measure when the queued work actually ran, in every mode.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from ...torch_compat import storage_id
from .race_checker import VectorClock

__all__ = ["EventOwner", "QueuedCopy", "QueuedRelease", "QueuedWait", "SimEvent", "SimStream", "StreamScheduler"]


class QueuedCopy:
    """``dst.copy_(src)`` waiting in a copy stream's queue."""

    __slots__ = ("direction", "dst", "src")

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
        self.dst = dst
        self.src = src
        self.direction = direction


class QueuedRelease:
    """A storage freed stream-ordered (``release_storage(..., in_use_on=stream)``): freed when the queue reaches it.

    ``position``, ``snapshot`` and ``modeled_at`` mark that point, which a later ``restore_storage`` of the
    storage is ordered after (a caching allocator hands the block back only then).
    """

    __slots__ = ("free", "modeled_at", "position", "snapshot", "stream")

    def __init__(
        self,
        free: Callable[[], None],
        stream: SimStream,
        position: int,
        snapshot: VectorClock | None,
        modeled_at: float | None,
    ) -> None:
        self.free: Callable[[], None] | None = free
        self.stream = stream
        self.position = position
        self.snapshot = snapshot
        self.modeled_at = modeled_at

    def run(self) -> None:
        """Free the storage (once; the reference to it goes with it)."""
        free, self.free = self.free, None
        if free is not None:
            free()


class QueuedWait:
    """Later work of the stream may not start before ``event`` completes."""

    __slots__ = ("event",)

    def __init__(self, event: SimEvent) -> None:
        self.event = event


class SimStream:
    """A simulated stream; ``enqueued``/``completed`` count queued ops and give events their positions."""

    __slots__ = ("completed", "enqueued", "is_compute", "name", "queue", "unfinished_events")

    def __init__(self, name: str, *, is_compute: bool = False) -> None:
        self.name = name
        self.is_compute = is_compute
        self.queue: deque[QueuedCopy | QueuedWait | QueuedRelease] = deque()
        self.enqueued = 0
        self.completed = 0
        self.unfinished_events: deque[SimEvent] = deque()
        """Events recorded behind pending work, in position order, waiting for their completion time."""

    def stamp_finished_events(self) -> None:
        """Give the events the queue has now run up to their completion time: the host clock now."""
        events = self.unfinished_events
        if events and events[0].position <= self.completed:
            now = time.perf_counter()
            while events and events[0].position <= self.completed:
                events.popleft().completed_at = now

    def __repr__(self) -> str:
        return f"SimStream({self.name!r}, pending={len(self.queue)})"


class EventOwner(Protocol):
    """The machine an event reports to, so that waiting on it can force queues and order the host."""

    def query_event(self, event: SimEvent) -> bool: ...

    def synchronize_event(self, event: SimEvent) -> None: ...


class SimEvent:
    """The point of ``stream``'s queue reached when the event was recorded."""

    __slots__ = ("completed_at", "modeled_at", "owner", "position", "recorded_at", "snapshot", "stream")

    def __init__(
        self, owner: EventOwner, stream: SimStream, position: int, snapshot: VectorClock | None, recorded_at: float
    ) -> None:
        self.owner = owner
        self.stream = stream
        self.position = position
        self.snapshot = snapshot
        self.recorded_at = recorded_at
        """Host clock when recorded."""
        self.modeled_at: float | None = None
        """Virtual time of the work before the event (with a timing model; see ``swap_core.backends.sim.timing``)."""
        self.completed_at: float | None = recorded_at if self.done else None
        """Host clock when the work before the event had run: the simulated clock (``None`` until then)."""
        if self.completed_at is None:
            stream.unfinished_events.append(self)

    @property
    def done(self) -> bool:
        """Whether the work before the event has run (without ordering the host after it)."""
        return self.stream.completed >= self.position

    def query(self) -> bool:
        """Whether the work before the event has run; never runs queued work, so lazy-mode polling spins."""
        return self.owner.query_event(self)

    def synchronize(self) -> None:
        """Run the stream up to the event and order the host after it."""
        self.owner.synchronize_event(self)

    def __repr__(self) -> str:
        return f"SimEvent({self.stream.name!r}, position={self.position}, done={self.done})"


def _moved(tensor: torch.Tensor, key: int, storage: torch.UntypedStorage) -> torch.Tensor:
    """``tensor``, or the same view of ``storage`` when ``tensor`` lives in the storage ``key``."""
    if storage_id(tensor.untyped_storage()) != key:
        return tensor
    moved = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return moved.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())


class StreamScheduler:
    """Owns the streams and runs queued work in FIFO order when forced.

    Forcing never deadlocks: a wait can only name an event recorded before the wait
    was enqueued, so the chain of forced streams always ends.
    """

    def __init__(self, execute_copy: Callable[[QueuedCopy], None]) -> None:
        self._execute_copy = execute_copy
        self.compute = SimStream("compute", is_compute=True)
        self.copy_streams: list[SimStream] = []

    def new_stream(self) -> SimStream:
        stream = SimStream(f"stream{len(self.copy_streams) + 1}")
        self.copy_streams.append(stream)
        return stream

    def enqueue(self, stream: SimStream, op: QueuedCopy | QueuedWait | QueuedRelease) -> None:
        stream.queue.append(op)
        stream.enqueued += 1
        self._run_releases(stream)

    def force(self, stream: SimStream, position: int) -> None:
        """Run ``stream``'s queue until ``position`` ops have completed (and the releases right behind them)."""
        while stream.completed < position:
            self._run_head(stream)
        self._run_releases(stream)

    def _run_releases(self, stream: SimStream) -> None:
        """A release at the head of the queue frees its memory now: the work before it is done, as with a caching
        allocator's ``record_stream``, whose block is free once the events recorded at the release complete."""
        while stream.queue and isinstance(stream.queue[0], QueuedRelease):
            self._run_head(stream)

    def drain(self, stream: SimStream) -> None:
        self.force(stream, stream.enqueued)

    def drain_all(self) -> None:
        for stream in self.copy_streams:
            self.drain(stream)

    def pending(self) -> int:
        return sum(len(stream.queue) for stream in self.copy_streams)

    def redirect(self, key: int, storage: torch.UntypedStorage) -> None:
        """Queued copies that touch the storage ``key`` use ``storage`` (a copy of its bytes) instead."""
        for stream in self.copy_streams:
            for op in stream.queue:
                if isinstance(op, QueuedCopy):
                    op.dst = _moved(op.dst, key, storage)
                    op.src = _moved(op.src, key, storage)

    def run_random(self, rng: random.Random) -> None:
        """Maybe run a random prefix of a random busy copy stream (every head is runnable by forcing)."""
        if rng.random() < 0.5:
            return
        busy = [stream for stream in self.copy_streams if stream.queue]
        if not busy:
            return
        stream = rng.choice(busy)
        self.force(stream, stream.completed + rng.randint(1, len(stream.queue)))

    def _run_head(self, stream: SimStream) -> None:
        op = stream.queue[0]
        if isinstance(op, QueuedWait):
            self.force(op.event.stream, op.event.position)
        # Pop before running: a copy that fails is dropped, like a faulted kernel, so the queue cannot wedge.
        stream.queue.popleft()
        stream.completed += 1
        try:
            if isinstance(op, QueuedCopy):
                self._execute_copy(op)
            elif isinstance(op, QueuedRelease):
                op.run()
        finally:
            stream.stamp_finished_events()
