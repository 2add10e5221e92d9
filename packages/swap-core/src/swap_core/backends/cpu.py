"""The backend of CPU parameters in master-weights mode: the swap runtime runs, nothing is swapped.

With CPU parameters there is no device memory to save, so ``backend="auto"`` runs the wrapped
optimizer unchanged. Master weights change the math (the update runs on fp32 masters), so there
the runtime runs on the CPU instead, with every state and master resident: the same code path, and
so the same numbers, as on an accelerator. "Device" memory is CPU memory, in order (the
simulator's synchronous schedule, without its checks, which no copy would exercise).
"""

from __future__ import annotations

from .sim import SimBackend

__all__ = ["CpuBackend"]


class CpuBackend(SimBackend):
    """CPU memory as the device, every stream synchronous, no checks: for a runtime that swaps nothing."""

    def __init__(self) -> None:
        super().__init__(mode="sync", check_races=False, poison=False, pinned_memory=False)

    def __repr__(self) -> str:
        return "CpuBackend()"

    @property
    def name(self) -> str:
        return "cpu"

    @property
    def host_is_device(self) -> bool:
        """The parameters are on the CPU: host memory is the device's, and nothing stays resident to save it."""
        return True
