"""What one swapped ``step()`` moved and held."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .trace import StepTrace

__all__ = ["CopyCounts", "SwapStats", "link_bytes_per_second", "traced_link_bytes_per_second"]

COPY_PHASES = ("h2d", "d2h")
"""The phases of a step's trace that move bytes over the host link."""


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

    batches_taken_back: int = 0
    """With ``SwapConfig(step="in_backward")``: the batches updated provisionally inside the backward that ``step()``
    took back before stepping after the backward (what they read changed since: a clipped gradient, a new learning
    rate...); their work was redone in ``batches``. 0 when the step committed."""

    host_spare_bytes: int = 0
    """Host bytes of the second copy of the swapped states that provisional updates keep
    (``SwapConfig(provisional_updates=True)`` with ``step="in_backward"``; 0 otherwise): what a walk inside the
    backward copies out to, so that the first stays as it was until ``step()`` commits."""

    host_param_copy_bytes: int = 0
    """Pinned host bytes in which provisional updates keep the parameters they write (those without an fp32 master),
    to put them back if the step is taken back; 0 without provisional updates."""

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

    link_bytes_per_second: float | None = None
    """The rate the step's copies achieved over the host link, both directions together: the bytes they moved
    host-to-device plus device-to-host, over the step's transfer window, from the start of its first copy to the end
    of its last one (time in which the link idled between copies counts). Compare it with the raw rate of pinned
    copies run both ways at once (``swap-bench device-perf`` does).

    - On the simulator's virtual clock (``SimBackend(timing=...)``): ``(h2d_bytes + d2h_bytes) /
      modeled_transfer_seconds``, a ``prefetch()``'s copy-in included, exactly.
    - Elsewhere, only with ``SwapConfig(trace=True)``: the bytes of the ``"h2d"`` and ``"d2h"`` intervals of the
      step's trace (:attr:`~swap_core.SwapOptimizer.trace`) over the time from the first one's start to the last
      one's end, timed with the device's timing events (on the simulator without a clock, the host times its copies
      ran at, as its traces are). The trace starts where the step's walk begins, so a copy-in that ``prefetch()``
      issued before it is in neither the bytes nor the time.
    - ``None`` on an untraced step without a virtual clock (timing the copies needs device events, which the host
      would have to wait for: only a traced step does), and when the step copied nothing."""


def link_bytes_per_second(nbytes: int, seconds: float | None) -> float | None:
    """``nbytes`` over ``seconds``: the rate of :attr:`SwapStats.link_bytes_per_second`; ``None`` when nothing was
    moved or no time was taken (``seconds`` ``None``: nothing timed it)."""
    if nbytes <= 0 or seconds is None or seconds <= 0:
        return None
    return nbytes / seconds


def traced_link_bytes_per_second(trace: StepTrace | None) -> float | None:
    """:attr:`SwapStats.link_bytes_per_second` of a traced step: the bytes of its copies over the time from the start
    of the first to the end of the last; ``None`` without a trace."""
    if trace is None:
        return None
    copies = [interval for interval in trace.intervals if interval.phase in COPY_PHASES]
    if not copies:
        return None
    window = max(interval.end for interval in copies) - min(interval.start for interval in copies)
    return link_bytes_per_second(sum(interval.nbytes for interval in copies), window)
