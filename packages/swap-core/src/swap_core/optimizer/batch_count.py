"""How many batches a plan gets, chosen once at wrapping: ``swap_times``'s number (:class:`FixedBatchCount`), or
``swap_times="auto"``'s fewest that fit the device memory, raised after an out-of-memory while staging
(:class:`AutoBatchCount`)."""

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

__all__ = ["AutoBatchCount", "BatchCount", "FixedBatchCount"]

_LOG = logging.getLogger("swap_core")


class FixedBatchCount:
    """``swap_times`` batches, every plan; an out-of-memory is the step's error (nothing to retry with)."""

    available: int | None = None
    """Not measured: ``None``."""

    def __init__(self, count: int, min_numel: int) -> None:
        self.count = count
        self.min_numel = min_numel
        self._warned: tuple[int, int] | None = None

    @property
    def replans_after_out_of_memory(self) -> bool:
        return False

    def batches(self, staging_of: Callable[[int], int], most: int, *, agree: Callable[[int], int] | None) -> int:
        """``swap_times``."""
        return self.count

    def log(self, plan: SwapPlan) -> None:
        """Warn once, for each plan that splits into fewer batches than asked, why: a batch holds whole parameters."""
        got = sum(1 for batch in plan.batches if batch.slots)  # batches that move states (none: nothing swapped)
        if not 0 < got < self.count or self._warned == (self.count, got):
            return
        self._warned = (self.count, got)
        warn_user(
            f"SwapConfig(swap_times={self.count}) asked for {self.count} batches, but only {got} parameters have "
            f"swapped states and a batch holds whole parameters: each step runs {got} batches, so the device holds "
            f"a larger share of the state at its peak than {self.count} would give. The states of tensors under "
            f"min_numel={self.min_numel} elements stay on the device; with more (or smaller) swapped parameters "
            "the batches split as asked",
            UserWarning,
        )

    def retry_after(
        self, error: torch.OutOfMemoryError, *, updates_begun: int, retried: bool, last: SwapPlan | None
    ) -> bool:
        """Never."""
        return False


class AutoBatchCount:
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

    def batches(self, staging_of: Callable[[int], int], most: int, *, agree: Callable[[int], int] | None) -> int:
        """The fewest batches (of at most ``most``, one parameter each) whose staging (``staging_of(count)``) fits;
        ``agree``: where every rank walks the same batches, the count that fits every rank (from this rank's), and
        no rank retries alone."""
        fits_nowhere: DeviceMemoryError | None = None
        try:
            count = self._choose(staging_of, most)
        except DeviceMemoryError as error:
            if agree is None:
                raise
            fits_nowhere, count = error, most + 1  # the others must learn it, not wait for this rank
        if agree is not None:
            count = agree(count)
            if count > most:
                raise fits_nowhere or DeviceMemoryError(
                    "swap_times='auto': another rank's device cannot stage even one parameter per batch "
                    "(its error names the bytes); every rank stops before anything changes"
                )
        # A rank cannot retry alone with more batches where every rank must walk the same ones.
        self._tried = (count, most) if agree is None else None
        return count

    def _choose(self, staging_of: Callable[[int], int], most: int) -> int:
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

    @property
    def replans_after_out_of_memory(self) -> bool:
        return True

    def retry_after(
        self, error: torch.OutOfMemoryError, *, updates_begun: int, retried: bool, last: SwapPlan | None
    ) -> bool:
        """After an out-of-memory: whether the step may run again over a plan with twice the batches (before any
        update began, once); a second one raises :class:`~swap_core.errors.DeviceMemoryError` (``last``: the plan
        that ran out)."""
        if retried:
            raise self._still_out_of_memory(error, last) from error
        return self._more_batches_after(error, updates_begun)

    def _more_batches_after(self, error: torch.OutOfMemoryError, updates_begun: int) -> bool:
        """An out-of-memory before any update began (the staging did not fit): plan twice the batches from now on
        and say so; ``True`` when the step may run again."""
        tried = self._tried
        if updates_begun or tried is None:
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

    def _still_out_of_memory(self, error: torch.OutOfMemoryError, plan: SwapPlan | None) -> DeviceMemoryError:
        """The error of a step whose retry with twice the batches ran out of device memory too (nothing updated)."""
        staging = f"{plan.peak_staging_bytes} bytes of staging" if plan is not None else "its staging"
        return DeviceMemoryError(
            f"swap_times='auto': the device ran out of memory again with {self.floor} batches ({staging}, "
            f"{self.backend.available_device_bytes()} bytes available now): {error}. Nothing was updated. Free "
            "device memory, lower device_memory_fraction (more margin for the rest of the step), keep fewer states "
            "on the device (offload_fraction=1.0, a smaller min_numel), or set swap_times to a larger number"
        )


BatchCount = FixedBatchCount | AutoBatchCount
"""How a plan's batches are counted (chosen once at wrapping, :func:`batch_count`)."""


def batch_count(config: SwapConfig, backend: DeviceBackend) -> BatchCount:
    """The batch count ``config.swap_times`` asks for."""
    if config.swap_times == "auto":
        return AutoBatchCount(config, backend)
    return FixedBatchCount(config.swap_times, config.min_numel)
