"""The runtime of a swapped optimizer: made once at wrapping, absent where nothing is swapped (CPU parameters)."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import torch

from ..adapters.base import StateSwapAdapter, UpdateBatch
from ..backends.protocol import DeviceBackend
from ..config import SwapConfig
from ..master_weights.update import update_on_masters
from ..runtime.pipeline import PipelineScheduler, drain_in_flight_copies
from ..runtime.plan import SwapPlan
from ..stats import SwapStats
from ..trace import StepTrace
from .auto_batching import AutoBatching
from .in_backward import InBackwardStep
from .loading import STATES_BEFORE_WRAPPING, make_masters_of_existing_states
from .plan_cache import PlanCache
from .prefetching import Prefetching
from .state_creation import state_creation
from .state_sync import StateSync
from .step_run import StepRun

__all__ = ["Swapping"]


@dataclasses.dataclass(frozen=True)
class Swapping:
    """What a :class:`~swap_core.SwapOptimizer` swaps with: the synced state, the plan cache, the prefetcher."""

    sync: StateSync
    plans: PlanCache
    prefetching: Prefetching
    update: Callable[[UpdateBatch], None]
    """The update of one batch segment: the adapter's, or the adapter's on fp32 masters (chosen once)."""
    in_backward: InBackwardStep | None
    """With ``SwapConfig(step="in_backward")``: the gradient hooks that update batches inside the backward."""

    @classmethod
    def start(
        cls,
        owner: torch.optim.Optimizer,
        optimizer: torch.optim.Optimizer,
        adapter: StateSwapAdapter,
        config: SwapConfig,
        backend: DeviceBackend,
    ) -> Swapping:
        """Take over ``optimizer``'s states for ``owner`` (its wrapper): host mirrors, masters, the first plan's
        cache, the backward's prefetch hooks. Copies in flight are waited for when ``owner`` is collected."""
        scheduler = PipelineScheduler(backend, duplex=config.duplex)
        weakref.finalize(owner, drain_in_flight_copies, scheduler)
        sync = StateSync(optimizer, adapter, config, scheduler)
        creation = state_creation(adapter, sync)
        plans = PlanCache(sync, creation, AutoBatching(config, backend) if config.swap_times == "auto" else None)
        sync.start()  # existing states move to host memory (may find the host too small)
        if config.master_weights:
            make_masters_of_existing_states(sync, STATES_BEFORE_WRAPPING)
        prefetching = Prefetching(owner, sync, plans, from_backward=config.prefetch == "backward")
        update = update_on_masters(adapter) if config.master_weights else _update(adapter)
        in_backward = InBackwardStep(owner, sync, plans, update) if config.step == "in_backward" else None
        return cls(sync, plans, prefetching, update, in_backward)

    @property
    def scheduler(self) -> PipelineScheduler:
        return self.sync.scheduler

    @property
    def transfers_started(self) -> bool:
        """Whether the next ``step()``'s copies began before it: a ``prefetch()``'s copy-in, or batches updated
        inside the backward (the step's transfer window then began there)."""
        began_in_backward = self.in_backward is not None and self.in_backward.started
        return self.scheduler.prefetched or began_in_backward

    def run_step(self, *, trace: bool) -> tuple[SwapStats, StepTrace | None, SwapPlan]:
        """One step on the batches, then the backward's prefetch armed for the next one; the step's stats, timeline
        (with ``trace``) and the plan it ran."""
        with self.scheduler.working():  # reads of the state here wait for nothing
            began = self.in_backward.finish() if self.in_backward is not None else None
            if began is not None:  # its batches updated inside the backward; the rest did now
                stats, plan, timeline = began
            else:
                stats, timeline, plan = self._attempt(trace=trace, retry=True)
            self.prefetching.arm(after_step=True)
            self.sync.empty_host_cache_after_relayout()
        return stats, timeline, plan

    def _attempt(self, *, trace: bool, retry: bool) -> tuple[SwapStats, StepTrace | None, SwapPlan]:
        """A :class:`StepRun`; with ``swap_times="auto"`` and ``retry``, a second one with twice the batches after an
        out-of-memory that left everything as it was (one that fails again raises ``DeviceMemoryError``)."""
        plans, stats, timeline = self.plans, SwapStats(), StepTrace() if trace else None
        run = StepRun(self.sync, plans, self.update)
        try:
            return stats, timeline, run.run(stats, timeline)
        except torch.OutOfMemoryError as error:
            if plans.auto is None:
                raise
            if not retry:
                raise plans.auto.still_out_of_memory(error, plans.last) from error
            if not plans.auto.more_batches_after(error, run.batches_updated):
                raise
        finally:
            run.release()  # zero_grad(set_to_none=True) must be able to free the gradients
        plans.drop()
        return self._attempt(trace=trace, retry=False)

    def count_memory(self, stats: SwapStats, plan: SwapPlan) -> None:
        """The memory figures of ``stats`` for a step that ran ``plan``."""
        resident = self.plans.resident_bytes
        stats.resident_state_device_bytes = resident
        stats.host_state_bytes = self.sync.store.host_bytes
        stats.host_pinned_bytes = self.sync.store.host_pinned_bytes
        stats.peak_state_device_bytes = plan.peak_staging_bytes + resident
        stats.available_device_bytes = self.plans.auto.available if self.plans.auto is not None else None


def _update(adapter: StateSwapAdapter) -> Callable[[UpdateBatch], None]:
    """``adapter.update``, looked up at each call (a test may replace it on the instance)."""

    def update(batch: UpdateBatch) -> None:
        adapter.update(batch)

    return update
