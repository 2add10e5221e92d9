"""What one swapped ``step()`` moved and held."""

from __future__ import annotations

import dataclasses

__all__ = ["CopyCounts", "SwapStats"]


@dataclasses.dataclass
class CopyCounts:
    """Copies between host and device, and their bytes, per direction."""

    h2d_bytes: int = 0
    """Bytes copied host to device (packed mode includes alignment padding between states)."""

    d2h_bytes: int = 0
    """Bytes copied device to host."""

    h2d_copies: int = 0
    """Host-to-device copy calls."""

    d2h_copies: int = 0
    """Device-to-host copy calls."""

    def count(self, direction: str, copies: int, nbytes: int) -> None:
        """Add ``copies`` copies of ``nbytes`` bytes in all in ``direction`` (``"h2d"`` or ``"d2h"``)."""
        if direction == "h2d":
            self.h2d_copies += copies
            self.h2d_bytes += nbytes
        elif direction == "d2h":
            self.d2h_copies += copies
            self.d2h_bytes += nbytes
        else:
            raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")


@dataclasses.dataclass
class SwapStats(CopyCounts):
    """Counters of the last ``step()``, exposed as ``opt.stats``."""

    batches: int = 0
    """Pipeline batches the swapped states were split into."""

    batches_in_backward: int = 0
    """With ``SwapConfig(step="in_backward")``: of those, the batches updated inside the backward (the others
    updated at ``step()``); 0 when the whole step ran after the backward."""

    peak_state_device_bytes: int = 0
    """Most device bytes held at once by swapped state (staging arenas or restored storages) and resident state: the
    plan's staging peak (per tensor, a step that skips batches without gradients may hold less, never more)."""

    resident_state_device_bytes: int = 0
    """Device bytes of optimizer state kept resident (not swapped) between steps."""

    host_state_bytes: int = 0
    """Host bytes holding this rank's swapped state (distributed families: only what the rank owns)."""

    host_pinned_bytes: int = 0
    """Host bytes this rank really pinned for them, rounding included (``SwapConfig.host_memory``): page-rounded
    buffers with ``"exact"``, power-of-two ones with ``"caching"``; 0 for pageable fallback memory."""

    step_seconds: float = 0.0
    """Host wall time of ``step()`` (asynchronous device work may still be running when it returns)."""

    modeled_step_seconds: float | None = None
    """On the simulator's virtual clock (``SimBackend(timing=...)``): how far the step pushed back the
    compute stream, i.e. the time a training loop loses to it (when the compute stream is free after
    the step's work, less when it was free, or the host issued ``step()``, at entry). With
    ``SwapConfig(step="in_backward")`` only what ``step()`` itself adds: the batches updated inside the backward
    are in the backward's time. ``None`` without a timing model."""

    modeled_transfer_seconds: float | None = None
    """On the virtual clock: from the step's first copy (at ``step()``'s entry, or earlier: a ``prefetch()``'s, or
    inside the backward with ``SwapConfig(step="in_backward")``) until its last offload finished. ``None`` without
    a timing model."""

    available_device_bytes: int | None = None
    """With ``swap_times="auto"``: the device bytes available (free, and cached unused) when the batches were chosen;
    ``None`` otherwise. ``batches`` and ``peak_state_device_bytes`` tell the choice."""
