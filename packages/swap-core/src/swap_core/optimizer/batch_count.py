"""``swap_times="auto"``: how many batches a plan gets, and what happens when the device runs out of memory."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..backends.protocol import DeviceBackend
from ..config import SwapConfig
from ..errors import DeviceMemoryError
from ..runtime.auto_batches import AUTO_NEEDS_MEMORY, fewest_batches_that_fit
from ..runtime.plan import SwapPlan
from ..user_warnings import warn_user

__all__ = ["AutoBatching"]

_LOG = logging.getLogger("swap_core")


class AutoBatching:
    """The choices of ``swap_times="auto"`` for one optimizer: the fewest batches that fit, raised after an
    out-of-memory while staging (see :mod:`~swap_core.runtime.auto_batches`)."""

    def __init__(self, config: SwapConfig, backend: DeviceBackend) -> None:
        self.config = config
        self.backend = backend
        self.floor = 1
        """The fewest batches to consider (raised after an out-of-memory while staging)."""
        self.available: int | None = None
        """The device bytes available when the current plan was chosen."""
        self._tried: tuple[int, int] | None = None
        """The batches of the last plan chosen and the most it could choose; ``None`` where no retry may run."""
        self._logged: tuple[int, int | None] | None = None

    def choose(self, staging_of: Callable[[int], int], most: int) -> int:
        """The fewest batches whose staging (``staging_of(count)``) fits the device memory available now (the plan
        it replaces was dropped when the state changed: its staging is free already)."""
        available = self.backend.available_device_bytes()
        if available is None:
            raise ValueError(AUTO_NEEDS_MEMORY.format(backend=self.backend.name))
        self.available = available
        config = self.config
        return fewest_batches_that_fit(
            staging_of,
            available,
            config.device_memory_fraction,
            at_least=self.floor,
            most=most,
            staging_buffers=config.staging_buffers,
        )

    def chose(self, count: int, most: int, *, may_retry: bool) -> None:
        """The plan about to be built has ``count`` batches (of at most ``most``). ``may_retry``: a rank may re-plan
        alone after an out-of-memory while building or running it (not where every rank must walk the same
        batches)."""
        self._tried = (count, most) if may_retry else None

    def log(self, plan: SwapPlan) -> None:
        """One log line per new choice: batches, staging bytes, device memory available."""
        choice = (len(plan.batches), self.available)
        if choice != self._logged:
            self._logged = choice
            _LOG.info(
                "swap_times='auto': %d batches, staging %d bytes of the %s bytes of device memory available "
                "(device_memory_fraction=%s)",
                len(plan.batches),
                plan.peak_staging_bytes,
                self.available,
                self.config.device_memory_fraction,
            )

    def more_batches_after(self, error: torch.OutOfMemoryError, batches_updated: int) -> bool:
        """An out-of-memory before any batch updated anything (the staging did not fit): plan twice the batches from
        now on and say so; ``True`` when the step may run again."""
        tried = self._tried
        if batches_updated or tried is None:
            return False
        batches, most = tried
        if batches >= most:
            return False  # one parameter per batch already
        self.floor = min(2 * batches, most)
        warn_user(
            f"swap_times='auto': the device ran out of memory staging {batches} batches ({error}); re-planned with "
            f"{self.floor} batches and running the step again. Nothing was updated before the retry",
            ResourceWarning,
        )
        return True

    def still_out_of_memory(self, error: torch.OutOfMemoryError, plan: SwapPlan | None) -> DeviceMemoryError:
        """The error of a step whose retry with twice the batches ran out of device memory too (nothing updated)."""
        staging = f"{plan.peak_staging_bytes} bytes of staging" if plan is not None else "its staging"
        return DeviceMemoryError(
            f"swap_times='auto': the device ran out of memory again with {self.floor} batches ({staging}, "
            f"{self.backend.available_device_bytes()} bytes available now): {error}. Nothing was updated. Free "
            "device memory, lower device_memory_fraction (more margin for the rest of the step), keep fewer states "
            "on the device (offload_fraction=1.0, a larger min_numel), or set swap_times to a larger number"
        )
