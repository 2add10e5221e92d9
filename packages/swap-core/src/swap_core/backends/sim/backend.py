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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

from swap_core.backends.host_memory import MAX_HOST_BUFFER_BYTES
from swap_core.backends.protocol import Event, Stream

from .copies import SimCopies
from .device_memory import SimDeviceMemory
from .faults import is_count
from .host_buffers import SimHostBuffers, SimHostMemory
from .machine import SimMachine
from .memory import HOST_KINDS, MemoryKind, storage_key
from .modeled_time import SimModeledTime
from .ordering import SimOrdering
from .race_checker import OnRace
from .timing import LinkModel, ModeledTimes

if TYPE_CHECKING:
    from swap_core.backends.protocol import DeviceBackend

__all__ = ["SIM_MODES", "SimBackend", "SimMode"]

SimMode = Literal["lazy", "random", "sync"]
SIM_MODES: tuple[SimMode, ...] = ("lazy", "random", "sync")
_ON_RACE: tuple[OnRace, ...] = ("raise", "record")


class SimBackend(SimHostMemory):
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
        max_registration_bytes: the largest ``mode="exact"`` buffer the simulated driver registers; a larger one
            falls back as with ``exact_pinning=False`` (some drivers refuse more than about 8-12 GiB at once). It is
            also :attr:`max_host_buffer_bytes`, the chunk size of packed host memory (default
            :data:`~swap_core.backends.host_memory.MAX_HOST_BUFFER_BYTES`).
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
        max_registration_bytes: int = MAX_HOST_BUFFER_BYTES,
        host_bytes: int | None = None,
        timing: LinkModel | None = None,
        caching_allocator: bool = True,
        device_memory: int | None = None,
    ) -> None:
        _check_arguments(mode, seed, on_race, host_bytes, device_memory, timing, max_registration_bytes)
        self.mode: SimMode = mode
        self.seed = seed
        self.check_races = check_races
        self.poison = poison
        self.pinned_memory = pinned_memory
        self.exact_pinning = exact_pinning
        self.max_registration_bytes = max_registration_bytes
        self.host_bytes = host_bytes
        self.device_memory = device_memory
        self.on_race: OnRace = on_race
        self.timing = timing
        self._machine = machine = SimMachine(
            self,
            self.device,
            random_seed=seed if mode == "random" else None,
            sync=mode == "sync",
            on_race=on_race if check_races else None,
            timing=timing,
            caching_allocator=caching_allocator,
        )
        self.races: list[str] = machine.race_checker.races if machine.race_checker is not None else []
        """Every race found so far (with ``on_race="raise"``, the ones raised)."""
        self._memory = SimDeviceMemory(machine, self)
        self._copies = SimCopies(machine)
        self.copy_stats = self._copies.stats
        """Copies and bytes per direction since construction or :meth:`reset_copy_stats`."""
        self._host = SimHostBuffers(machine, self)
        self._ordering = SimOrdering(machine)
        self._modeled_time = SimModeledTime(machine)

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
        record = self._machine.registry.lookup(storage_key(tensor))
        return record is None or record.kind is MemoryKind.DEVICE

    def adopt(self, tensor: torch.Tensor) -> None:
        """Track a parameter or gradient as device memory (nothing is counted: it was allocated before).

        Without checks nothing would ever look at the registration: return at once (called per gradient per step).
        """
        machine = self._machine
        if machine.race_checker is None and machine.rng is None:
            return
        machine.tick()
        if tensor.device != self.device:
            raise ValueError(
                f"{type(self).__name__} can only adopt tensors on {self.device}, got one on {tensor.device}"
            )
        record = machine.registry.lookup(storage_key(tensor))
        if record is None:
            machine.registry.register(tensor, MemoryKind.DEVICE)
        elif record.kind in HOST_KINDS:
            raise ValueError("Cannot adopt host memory from empty_host() as device memory")

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Poisoned device memory, written by the current stream: a copy stream filling it must wait for that."""
        return self._memory.empty(shape, dtype)

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
        self._memory.release_storage(tensor, in_use_on)

    def free_when_done(self, tensor: torch.Tensor, *, allocated_on: Stream, in_use_on: Stream) -> None:
        """The block's reuse, checked by the race checker (:meth:`SimDeviceMemory.free_when_done`)."""
        self._memory.free_when_done(tensor, allocated_on, in_use_on)

    def restore_storage(self, tensor: torch.Tensor) -> None:
        """Re-allocate a released storage (poisoned, counted, written by the current stream): its own cached block
        when the cache still holds it and it is free on this stream, else a cached block of its size whose storage
        is gone, else new memory."""
        self._memory.restore_storage(tensor)

    def available_device_bytes(self) -> int | None:
        """``device_memory`` less the bytes allocated (cached blocks are given back before an allocation fails), or
        ``None`` without a capacity."""
        return self._memory.available_device_bytes()

    def memory_allocated(self) -> int:
        """Device bytes from :meth:`empty` and :meth:`restore_storage` still alive."""
        return self._machine.registry.allocated_bytes

    def max_memory_allocated(self) -> int:
        """Peak of :meth:`memory_allocated` since construction or :meth:`reset_peak_memory_stats`."""
        return self._machine.registry.peak_bytes

    def memory_reserved(self) -> int:
        """Device bytes held: allocated plus cached by the caching allocator (freed blocks kept for reuse)."""
        return self._memory.memory_reserved()

    def max_memory_reserved(self) -> int:
        """Peak of :meth:`memory_reserved` since construction or :meth:`reset_peak_memory_stats`."""
        return self._memory.max_memory_reserved()

    def empty_cache(self) -> None:
        """Give every cached block back (``torch.cuda.empty_cache``): :meth:`memory_reserved` drops to what is
        allocated. Blocks whose stream-ordered free is still queued go too: they are never handed out again."""
        self._memory.empty_cache()

    def reset_peak_memory_stats(self) -> None:
        """Start the device (allocated and reserved) and the pinned-host peaks afresh from what is held now."""
        self._machine.registry.reset_peak()
        self._memory.reset_peak()

    # -- streams and events --------------------------------------------------
    def compute_stream(self) -> Stream:
        """The calling thread's current stream: the eager compute stream unless :meth:`stream` set another."""
        return self._machine.current_stream()

    def stream(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        """Make ``stream`` the calling thread's current stream for the block: compute ops inside ``compute_scope``
        and allocations are then issued to it (a copy stream made current runs its queue up to each such op
        first, so that its work stays in order)."""
        return self._machine.current(self._machine.own_stream(stream))

    def new_stream(self) -> Stream:
        """A copy stream: a queue that runs when forced (see ``mode``)."""
        return self._ordering.new_stream()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, stream: Stream) -> None:
        """Issue ``dst.copy_(src)`` on ``stream``; it runs at once on the compute stream, in sync mode, or when
        host memory is pageable, and otherwise when the stream is forced.

        Exactly one side must be host memory from :meth:`empty_host`, or both sides
        tracked device memory. A plain CPU tensor facing host memory is the device
        side (and, with checks on, is adopted as device memory from then on); a plain
        CPU tensor facing device memory stands for pageable host memory, which an
        asynchronous copy cannot use.
        """
        self._copies.copy(dst, src, stream)

    def record_event(self, stream: Stream, *, timing: bool = False) -> Event:
        """An event at the current end of ``stream`` (always complete on the eager compute stream).

        Every event is stamped with the host clock when it completes (see :meth:`elapsed_seconds`);
        ``timing`` changes nothing here.
        """
        return self._ordering.record_event(stream)

    def elapsed_seconds(self, start: Event, end: Event) -> float:
        """Simulated time between two events: host time between their completions (runs their streams up to them).

        An event completes when its stream's queued work before it has run; in ``sync`` mode that is when it
        was recorded, in ``lazy`` and ``random`` mode whenever that work was forced to run. With ``timing``,
        the virtual time between them instead (traces then show the modeled timeline, with its overlap).
        """
        return self._ordering.elapsed_seconds(start, end)

    def wait_event(self, stream: Stream, event: Event) -> None:
        """A copy stream queues the wait; the eager compute stream runs the event's stream up to it right away."""
        self._ordering.wait_event(stream, event)

    def synchronize(self) -> None:
        """Run every queue to its end; the host is then ordered after all issued work."""
        self._ordering.synchronize()

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
        return self._machine.scope(timed=True)

    def host_scope(self) -> contextlib.AbstractContextManager[None]:
        """Check every op inside as the host's access to host buffers (and the current stream's to device memory)
        when ``check_races`` is on: a read or write of a host buffer that a copy still in flight writes or reads
        is a race. Nothing is timed, and nothing queued is run: the ops see what the schedule has done so far."""
        return self._machine.scope(timed=False)

    def read_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor.to("cpu")`` of a device tensor: the current stream's queued work runs first, the host waits for
        that stream and, on the virtual clock, for the bytes to cross the link too; the copy is plain memory."""
        return self._ordering.read_to_host(tensor)

    def model_compute(self, seconds: float) -> None:
        """Put ``seconds`` of modeled work (a forward and backward) on the compute stream's virtual timeline."""
        self._modeled_time.model_compute(seconds)

    def model_collective(self, received_bytes: int, sent_bytes: int) -> float:
        """Put a collective's traffic on the virtual clock (an FSDP all-gather or reduce-scatter of this rank:
        ``received_bytes`` in, ``sent_bytes`` out, at once); returns when the last byte has arrived. It shares the
        host link with the copies when ``LinkModel.network_gbps`` is set, and takes no time otherwise."""
        return self._modeled_time.model_collective(received_bytes, sent_bytes)

    def model_wait(self, until: float) -> None:
        """The current stream starts no later work before ``until`` (virtual seconds: a collective's result)."""
        self._modeled_time.model_wait(until)

    def model_host_read(self) -> None:
        """The host reads a value the current stream computes (``loss.item()``): on the virtual clock it waits for
        that stream's work so far."""
        self._modeled_time.model_host_read()

    def modeled_times(self) -> ModeledTimes | None:
        """Where the virtual clock stands now, or ``None`` without ``timing``."""
        return self._modeled_time.modeled_times()

    def start_transfer_window(self) -> None:
        """From now on, :meth:`modeled_times` notes when the first copy issued starts (``transfers_started``), on the
        copy streams' timelines; nothing without ``timing``."""
        self._modeled_time.start_transfer_window()

    # -- simulator extras ------------------------------------------------------
    def fail_copy(self, at: int, direction: str | None = None) -> None:
        """Arm a one-shot fault: the ``at``-th next :meth:`copy` call (0-based; of ``direction`` only, when given)
        raises :class:`~swap_core.errors.SimInjectedFault` before anything is issued."""
        self._copies.fail(at, direction)

    def reset_copy_stats(self) -> None:
        """Zero :attr:`copy_stats` in place (references to it stay valid)."""
        self._copies.reset_stats()

    def pending_ops(self) -> int:
        """Copies and waits issued to copy streams that have not run yet."""
        return self._machine.scheduler.pending()

    def memory_kind(self, tensor: torch.Tensor) -> MemoryKind | None:
        """What ``tensor``'s storage simulates; ``None`` for a plain CPU tensor."""
        record = self._machine.registry.lookup(storage_key(tensor))
        return None if record is None else record.kind


if TYPE_CHECKING:

    def _conforms_to_protocol(backend: SimBackend) -> DeviceBackend:
        return backend


def _check_arguments(
    mode: object,
    seed: object,
    on_race: object,
    host_bytes: object,
    device_memory: object,
    timing: object,
    max_registration_bytes: object,
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
    if not is_count(max_registration_bytes) or max_registration_bytes == 0:
        raise ValueError(f"Invalid max_registration_bytes: {max_registration_bytes!r}; expected an int > 0")
    if timing is not None and not isinstance(timing, LinkModel):
        raise TypeError(f"SimBackend timing must be a LinkModel or None, got {type(timing).__name__}")
