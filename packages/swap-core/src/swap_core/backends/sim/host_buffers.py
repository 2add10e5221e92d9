"""The simulator's host buffers: what a real device would pin for each, and the process's pinned bytes.

:meth:`SimHostBuffers.empty_host` makes poisoned 1-D host buffers and books, in the simulator's memory
registry, the bytes a real device would pin for them (:mod:`~swap_core.backends.host_memory`): exact-size
registration, the caching pinned allocator's power-of-two blocks, or pageable memory when pinning is
simulated to fail (each fallback warned once).
"""

from __future__ import annotations

import torch

from ..host_memory import HOST_MEMORY_MODES, HostMemoryMode, available_host_bytes, pinned_size, warn_pinning_once
from .faults import is_count
from .machine import SimMachine, SimSettings
from .memory import MemoryKind, poison_storage, storage_key

__all__ = ["SimHostBuffers", "SimHostMemory"]


class SimHostBuffers:
    """Host buffers of one :class:`~swap_core.sim.SimBackend` (which delegates its host-memory methods here)."""

    def __init__(self, machine: SimMachine, settings: SimSettings) -> None:
        self._machine, self._settings = machine, settings

    def empty_host(self, numel: int, dtype: torch.dtype, mode: HostMemoryMode) -> torch.Tensor:
        """See :meth:`SimBackend.empty_host`."""
        if not is_count(numel):
            raise ValueError(f"Invalid host buffer size: {numel!r}; expected an int >= 0")
        if mode not in HOST_MEMORY_MODES:
            raise ValueError(f"Invalid host memory mode: {mode!r}; expected one of {HOST_MEMORY_MODES}")
        machine = self._machine
        machine.tick()
        with machine.untracked():
            tensor = torch.empty(numel, dtype=dtype, device=machine.device)
            if self._settings.poison:
                poison_storage(tensor)
        if not self._settings.pinned_memory:
            warn_pinning_once(
                machine.warned,
                "pageable",
                "Pinned host memory is unavailable (SimBackend(pinned_memory=False) simulates a failed pin); "
                "falling back to pageable memory: host<->device copies become synchronous and no longer overlap "
                "with compute.",
                stacklevel=3,
            )
            machine.registry.register(tensor, MemoryKind.PAGEABLE_HOST)
            return tensor
        too_large = numel * dtype.itemsize > self._settings.max_registration_bytes
        if mode == "exact" and (too_large or not self._settings.exact_pinning):
            why = (
                f"a buffer of {numel * dtype.itemsize} bytes is over the {self._settings.max_registration_bytes} "
                "the simulated driver registers at once"
                if too_large
                else "registering the buffer with the driver failed"
            )
            warn_pinning_once(
                machine.warned,
                "caching",
                f"Simulated: exact-size pinning failed ({why}); host buffers come from the caching pinned "
                "allocator, which rounds each one up to a power of two",
                stacklevel=3,
            )
            mode = "caching"
        record = machine.registry.register(tensor, MemoryKind.HOST)
        machine.registry.pin(record, pinned_size(numel * dtype.itemsize, mode), registered=mode == "exact")
        return tensor

    def pinned_bytes(self, buffer: torch.Tensor) -> int:
        """See :meth:`SimBackend.pinned_bytes`."""
        record = self._machine.registry.lookup(storage_key(buffer))
        return record.pinned_bytes if record is not None else 0


class SimHostMemory:
    """:class:`~swap_core.sim.SimBackend`'s host-memory methods (of the backend protocol), over its
    :class:`SimHostBuffers` and memory registry."""

    _host: SimHostBuffers
    _machine: SimMachine
    host_bytes: int | None
    max_registration_bytes: int

    def empty_host(self, numel: int, dtype: torch.dtype, *, mode: HostMemoryMode = "exact") -> torch.Tensor:
        """A poisoned 1-D host buffer that counts what a real one would pin (:mod:`~swap_core.backends.host_memory`).

        Pageable (copies run synchronously) when pinning is simulated to fail; the caching path, with
        its power-of-two rounding, when exact registration is (``exact_pinning=False``).
        """
        return self._host.empty_host(numel, dtype, mode)

    def pinned_bytes(self, buffer: torch.Tensor) -> int:
        """What a real device would have pinned for ``buffer`` (0 for pageable or device memory)."""
        return self._host.pinned_bytes(buffer)

    @property
    def max_host_buffer_bytes(self) -> int:
        """``max_registration_bytes``: the simulated driver registers no larger buffer."""
        return self.max_registration_bytes

    def host_pinned_bytes(self) -> int:
        """Pinned host bytes of the process: every live :meth:`empty_host` buffer (rounding included), and the blocks
        torch's caching pinned allocator keeps after their ``host_memory="caching"`` buffers were freed (as
        ``torch.cuda.host_memory_stats()`` counts them) until :meth:`empty_host_cache`."""
        return self._machine.registry.process_pinned_bytes

    def empty_host_cache(self) -> None:
        """Give the caching pinned allocator's cached blocks back (``torch._C._host_emptyCache()``)."""
        self._machine.registry.empty_host_cache()

    def max_host_pinned_bytes(self) -> int:
        """Peak of :meth:`host_pinned_bytes` since construction or :meth:`reset_peak_memory_stats`."""
        return self._machine.registry.peak_pinned_bytes

    def available_host_bytes(self) -> int | None:
        """The real host's available memory, or ``host_bytes`` less the live pinned buffers when one was given."""
        if self.host_bytes is None:
            return available_host_bytes()
        return self.host_bytes - self.host_pinned_bytes()
