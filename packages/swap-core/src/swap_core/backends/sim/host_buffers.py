"""The simulator's host buffers: what a real device would pin for each, and the process's pinned bytes.

:meth:`SimHostBuffers.empty_host` makes poisoned 1-D host buffers and books, in the simulator's memory
registry, the bytes a real device would pin for them (:mod:`~swap_core.backends.host_memory`): exact-size
registration, the caching pinned allocator's power-of-two blocks, or pageable memory when pinning is
simulated to fail (each fallback warned once).
"""

from __future__ import annotations

import torch

from ..host_memory import HOST_MEMORY_MODES, HostMemoryMode, pinned_size, warn_pinning_once
from .faults import is_count
from .machine import SimMachine, SimSettings
from .memory import MemoryKind, poison_storage, storage_key

__all__ = ["SimHostBuffers"]


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
        if mode == "exact" and not self._settings.exact_pinning:
            warn_pinning_once(
                machine.warned,
                "caching",
                "Simulated: exact-size pinning (registering the buffer with the driver) failed; host buffers come "
                "from the caching pinned allocator, which rounds each one up to a power of two",
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
