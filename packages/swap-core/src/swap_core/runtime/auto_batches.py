"""``swap_times="auto"``: the fewest batches whose staging fits the device memory available.

Fewer batches mean fewer launches and larger copies; more mean less staging on the device. The partition of each
batch count tells its staging bytes exactly (the two arenas, or the two largest neighbouring batches per tensor:
:func:`~swap_core.runtime.plan.staging_bytes`) without allocating anything, so the choice is the fewest batches
whose staging fits ``device_memory_fraction`` of the device memory available when the swap is planned. The search
doubles the count until it fits, then halves the interval: staging shrinks as batches are added (their largest
batches do), so the first count that fits is the fewest.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import DeviceMemoryError

__all__ = ["AUTO_NEEDS_MEMORY", "fewest_batches_that_fit"]

AUTO_NEEDS_MEMORY = (
    "swap_times='auto' needs a backend that reports its available device memory (cuda, npu, or "
    "SimBackend(device_memory=...)); the {backend} backend does not. Set swap_times to a number"
)
"""The refusal of ``"auto"`` on a backend that cannot tell its available memory (``.format(backend=name)``)."""


def fewest_batches_that_fit(
    staging_of: Callable[[int], int],
    available: int,
    fraction: float,
    *,
    at_least: int,
    most: int,
    staging_buffers: int = 2,
) -> int:
    """The fewest batches, from ``at_least`` to ``most``, whose staging (``staging_of(batches)`` bytes) fits
    ``fraction`` of ``available`` device bytes; :class:`~swap_core.errors.DeviceMemoryError` when not even ``most``
    does (naming ``staging_buffers`` among the remedies when it is above two)."""
    budget = int(available * fraction)
    most = max(most, 1)
    low = min(max(at_least, 1), most)
    if staging_of(low) <= budget:
        return low
    high = low
    while True:  # double until a count fits
        if high >= most:
            fewer = (
                f"stage fewer batches at a time (staging_buffers=2 instead of {staging_buffers}), "
                if staging_buffers > 2
                else ""
            )
            raise DeviceMemoryError(
                f"swap_times='auto': even {most} batches (one parameter each) need {staging_of(most)} bytes of "
                f"staging on the device, over the {budget} bytes allowed ({fraction} of the {available} bytes "
                "available). Free device memory, raise device_memory_fraction, keep fewer states on the device "
                f"(offload_fraction=1.0, a smaller min_numel), {fewer}or use more devices"
            )
        low, high = high, min(2 * high, most)
        if staging_of(high) <= budget:
            break
    while high - low > 1:  # the fewest in (low, high]: low does not fit, high does
        middle = (low + high) // 2
        if staging_of(middle) <= budget:
            high = middle
        else:
            low = middle
    return high
