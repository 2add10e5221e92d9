"""The step skeleton, and the driver that runs it after the backward.

One skeleton for every step: **plan** (:meth:`StepRun.prepare`: the user's edits followed, gradients read, missing
states made, the plan current), **walk** (the scheduler's ``begin``, an ``advance`` per batch, ``end``), **finish**
(the states made put in order, the next step's prefetch armed, the memory figures). With ``swap_times="auto"`` an
out-of-memory before any update began runs it once more over a plan with twice the batches
(:meth:`PlanCache.retry_after`, the one place that decides it).

Which driver runs it is chosen once at wrapping: :class:`AfterBackward` walks every batch in ``step()``; the
in-backward driver (:mod:`swap_core.optimizer.in_backward`) begins the walk in the backward's gradient hooks,
advances it there batch by batch and ends it in ``step()``, with the same skeleton and the same retry. A driver owns
what its mode adds (its hooks, its checks at ``step()``); nothing below it reads which mode runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch

from ..adapters.base import StateSwapAdapter
from ..runtime.plan import SwapPlan
from ..stats import SwapStats, traced_link_bytes_per_second
from ..trace import StepTrace
from .plan_cache import PlanCache
from .prefetching import Prefetching
from .setup import SwapSetup
from .state_sync import StateSync
from .step_run import StepRun

__all__ = ["AfterBackward", "StepDriver", "StepOutcome"]


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What one ``step()`` did: its counters, its timeline (``SwapConfig(trace=True)``) and the plan it walked."""

    stats: SwapStats
    trace: StepTrace | None
    plan: SwapPlan | None
    """``None`` when the step was skipped (``GradScaler`` found an inf or a NaN)."""

    @property
    def skipped(self) -> bool:
        """Whether nothing was updated (as torch's ``GradScaler`` skips a step)."""
        return self.plan is None


class StepDriver:
    """Runs a swapped optimizer's steps (see the module); the driver of a mode subclasses it."""

    claims_amp_scaling = False
    """Whether ``GradScaler`` is to hand the step its scale instead of unscaling the gradients itself (a driver that
    cannot take it then refuses it, :meth:`refuse_amp_scaling`)."""
    updates_resident_first = True
    """Parameters without a swapped state update first, while batch 0 is copied in."""
    walks_last_batch_first = False
    """The batches are walked from the first parameters to the last (``prefetch="backward"`` reverses them)."""
    updates_before_step = False
    """Whether batches update before ``step()`` (then those updates may be provisional)."""

    @classmethod
    def check_supported(cls, adapter: StateSwapAdapter, params: list[torch.Tensor]) -> None:
        """Refuse, before anything changes, what this driver cannot run (nothing, here)."""

    def __init__(self, owner: object, setup: SwapSetup, sync: StateSync, plans: PlanCache) -> None:
        """Drives the steps of ``owner`` (the optimizer; hooks a driver registers go when it is collected)."""
        self.setup = setup
        self.sync = sync
        self.plans = plans
        self.prefetching = Prefetching(owner, setup, plans, from_backward=setup.prefetch_from_backward)

    @property
    def transfers_started(self) -> bool:
        """Whether the next ``step()``'s copies began before it (a ``prefetch()``'s copy-in)."""
        return self.setup.scheduler.prefetched

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        """Backwards of micro-batches before the last one of a step: nothing to do after the backward."""
        return contextlib.nullcontext()

    def step(self) -> StepOutcome:
        """The skeleton, every batch walked now (the step after the backward)."""
        setup = self.setup
        scheduler = setup.scheduler
        with scheduler.working():  # reads of the state here wait for nothing
            for retried in (False, True):
                stats, trace = SwapStats(), setup.new_trace()
                run = StepRun(setup, self.sync, self.plans)
                try:
                    plan = run.prepare()
                    with setup.adapter.step_scope():
                        walk = scheduler.begin(
                            plan, run.update, stats, skip=run.skipped(plan), traced=trace is not None
                        )
                        scheduler.end(walk, trace=trace)
                except BaseException as error:
                    run.failed(error)
                    if not self.plans.retry_after(error, updates_begun=run.updates_begun, retried=retried):
                        raise
                    continue
                finally:
                    run.release()  # zero_grad(set_to_none=True) must be able to free the gradients
                run.finish()
                return self.finished(StepOutcome(stats, trace, plan))
        raise AssertionError("the second attempt returns or raises")

    def finished(self, outcome: StepOutcome) -> StepOutcome:
        """The end of every step: the next one's prefetch armed, cached host memory given back after a re-layout, and
        the memory figures of ``outcome.stats``."""
        self.prefetching.arm(after_step=True)
        self.sync.empty_host_cache_after_relayout()
        stats, plans = outcome.stats, self.plans
        stats.resident_state_device_bytes = plans.resident_bytes
        stats.host_state_bytes = self.sync.store.host_bytes
        stats.host_pinned_bytes = self.sync.store.host_pinned_bytes
        assert outcome.plan is not None, "a skipped step is not finished"
        stats.peak_state_device_bytes = outcome.plan.peak_staging_bytes + plans.resident_bytes
        stats.host_spare_bytes = self.sync.store.spare_bytes
        stats.available_device_bytes = self.setup.batch_count.available
        stats.link_bytes_per_second = traced_link_bytes_per_second(outcome.trace)  # a virtual clock's replaces it
        return outcome

    def skipped(self) -> StepOutcome:
        """A step that updates nothing (``GradScaler`` found an inf or a NaN): the next one's prefetch armed."""
        self.prefetching.arm(after_step=False)
        return StepOutcome(SwapStats(), None, None)

    def take_amp_scaling(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """``GradScaler`` handed ``step()`` its scale: only a driver that claims it is handed one."""
        raise AssertionError(f"{type(self).__name__} does not claim GradScaler's scale")

    def before_zero_grad(self, *, set_to_none: bool) -> None:
        """``zero_grad()`` is about to run: nothing to do after the backward."""

    def take_back_open_step(self) -> bool:
        """Take back a step begun before ``step()`` and not committed; whether one was open (none, here)."""
        return False

    def release(self) -> None:
        """The optimizer is closed: what the driver holds on to beyond a step goes (nothing, here)."""

    def what_goes_when_collected(self) -> list[Callable[[], object]]:
        """What the optimizer's finalizer runs when it is collected (none of it may hold the optimizer)."""
        return []


class AfterBackward(StepDriver):
    """Every batch updates in ``step()``, after the backward (``SwapConfig(step="after_backward")``)."""
