"""The simulator over meta tensors: a step's schedule, bytes and virtual times without its data.

A meta tensor has a shape, a dtype and a storage of a size, but no memory behind it, and every
torch op on meta tensors runs its shape logic only. :class:`MetaBackend` is the simulator with
meta tensors as both device and host memory: the real swap pipeline plans, packs, copies and
updates a model of any size in seconds, and the simulator counts what it would allocate, pin and
copy, exactly as for real tensors. With a :class:`~swap_core.backends.sim.timing.LinkModel`
the virtual clock times the step as it would run on that link and device (the ops the optimizer
issues are the ones it would issue on a device, with one difference: torch picks its single-tensor
kernels for meta tensors, where a CUDA device would run the foreach or fused ones).

Nothing is computed, so nothing can be checked: the schedule is the simulator's ``sync`` one,
without race checks or poison. Use the CPU simulator for correctness and this one for the
numbers of sizes that do not fit here (``swap-bench plan --tables``).
"""

from __future__ import annotations

import torch

from .sim import SimBackend
from .sim.timing import LinkModel

__all__ = ["MetaBackend"]


class MetaBackend(SimBackend):
    """Meta tensors as device and host memory: exact bytes, copies and virtual times, no data.

    Args:
        timing: the link and device to model (``None``: bytes and copies only).
        host_bytes: the available host memory of the modeled machine; ``None`` (the default) checks
            nothing, since this machine's memory says nothing about the planned one's.
        device_memory: the modeled device's capacity for staging and states on the device (``None``: unlimited).
    """

    def __init__(
        self, timing: LinkModel | None = None, *, host_bytes: int | None = None, device_memory: int | None = None
    ) -> None:
        super().__init__(
            mode="sync",
            check_races=False,
            poison=False,
            timing=timing,
            host_bytes=host_bytes,
            device_memory=device_memory,
        )

    def __repr__(self) -> str:
        return f"MetaBackend(timing={self.timing!r}, host_bytes={self.host_bytes!r})"

    @property
    def name(self) -> str:
        return "meta"

    @property
    def device(self) -> torch.device:
        """Device (and host) memory are meta tensors."""
        return torch.device("meta")

    def available_host_bytes(self) -> int | None:
        """``host_bytes`` less the live pinned buffers, or ``None`` (unknown: nothing is refused) without it."""
        if self.host_bytes is None:
            return None
        return super().available_host_bytes()
