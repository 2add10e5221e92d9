"""How a walk ends when it does not end at its last batch: a failure inside it, or its driver ending it where it is.

A walk that is not provisional wrote the host mirrors: its batches still only on the device (updated, not yet copied
out) are copied out, so that every mirror is current again, and those whose copy-in never reached an update keep
their (valid) mirrors; a copy-out that fails is retried at the next step or ``synchronize()`` (nothing is lost). A
provisional walk wrote only the spare host copies: its copies are waited for and its device copies dropped, its
mirrors the state before it. Either way the staging memory is freed once nothing uses it.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..backends.protocol import DeviceBackend, Event
from ..errors import SwapStateError
from ..stats import SwapStats
from .plan import PlannedBatch, SwapPlan
from .slots import SlotState, SwapSlot, transition
from .staging import Offloaded

if TYPE_CHECKING:
    from .batch_walk import BatchWalk

__all__ = ["WalkEnds"]


class WalkEnds:
    """The ends of a walk other than its last batch, for :class:`~swap_core.runtime.pipeline.PipelineScheduler`."""

    backend: DeviceBackend
    _open_walk: bool | None
    _timeline: object | None
    _last_offload: Event | None
    _offloads: dict[int, Event]
    _earlier_offloads: dict[int, Event]
    _in_flight: SwapPlan | None
    _offloaded: list[SwapSlot]
    _stranded: list[PlannedBatch]
    _stranded_plan: SwapPlan | None

    if TYPE_CHECKING:

        def offload_batch(self, batch: PlannedBatch, stats: SwapStats, *, to_spare: bool = False) -> Offloaded: ...

        def synchronize(self) -> None: ...

        def _finish_offloads(self) -> None: ...

    @contextlib.contextmanager
    def _recover_on_error(self, plan: SwapPlan, *, provisional: bool = False) -> Iterator[None]:
        try:
            yield
        except BaseException as error:
            if provisional:
                self._drop_walk(plan)
            else:
                self._recover(plan)
            # The failed update's frames still reference staging views whose storage is now released;
            # showing their locals (a debugger, pytest --showlocals) would read freed memory. Drop them.
            traceback.clear_frames(error.__traceback__)
            raise

    def _recover(self, plan: SwapPlan) -> None:
        """Drain every transfer and make each slot's host mirror authoritative again.

        Slots on the device hold the only current values (their update may have
        run, fully or partly): they are offloaded. Prefetched slots whose update
        never started still have valid host mirrors and are dropped. A walk begun by :meth:`begin` ends here.
        """
        self._open_walk = None
        self._stranded = [b for b in plan.batches if b.slots and b.slots[0].state is SlotState.DEVICE]
        self._stranded_plan = plan
        self._retry_stranded(final=False)
        for batch in plan.batches:
            if batch.slots and batch.slots[0].state is SlotState.H2D:
                transition(batch.slots, SlotState.H2D, SlotState.HOST)

    def abandon(self, walk: BatchWalk) -> None:
        """:meth:`abandon_plan` of ``walk``'s plan."""
        self.abandon_plan(walk.plan, provisional=walk.to_spare)

    def abandon_plan(self, plan: SwapPlan, *, provisional: bool) -> None:
        """End the walk over ``plan`` where it is, without updating the batches it has left (the optimizer is closed
        or collected, or its step is taken back). A provisional walk's copies are waited for, its device copies
        dropped (the host mirrors never changed: its copy-outs went to the spare copies) and its staging freed: the
        caller puts back what its updates wrote elsewhere. Any other walk ends as a failed step does: the batches
        updated and not yet copied out are copied out, so every host mirror is current (what they updated stays).
        Ending a walk that already ended (it failed) changes nothing more."""
        if provisional:
            self._drop_walk(plan)
            return
        self._recover(plan)
        self.synchronize()

    def _drop_walk(self, plan: SwapPlan) -> None:
        """A provisional walk ends here: every copy waited for, every slot back to its (unchanged) host mirror."""
        self._open_walk = None
        self._timeline = None
        self.backend.synchronize()
        self._last_offload = None
        self._offloads, self._earlier_offloads = {}, {}
        self._in_flight = None
        self._finish_offloads()  # copied out to the spare copies: done, and of no further use
        for batch in plan.batches:
            if batch.slots and batch.slots[0].state is SlotState.DEVICE:
                transition(batch.slots, SlotState.DEVICE, SlotState.HOST)  # the device copy is dropped
            elif batch.slots and batch.slots[0].state is SlotState.H2D:
                transition(batch.slots, SlotState.H2D, SlotState.HOST)
        plan.staging.release(plan.batches, in_use_on=None)  # the synchronize above ordered everything

    def _retry_stranded(self, *, final: bool) -> None:
        """Offload batches whose state is still only on the device, then free their staging memory."""
        plan = self._stranded_plan
        if plan is None:
            return
        for batch in list(self._stranded):
            try:
                self.offload_batch(batch, SwapStats())
            except Exception as error:
                if final:
                    raise SwapStateError(
                        f"Could not move batch {batch.index} back to host memory; its state is still on the device "
                        "and nothing is lost: call step() or synchronize() again to retry"
                    ) from error
                continue
            self._stranded.remove(batch)
        self.backend.synchronize()
        self._last_offload = None
        self._finish_offloads()
        if self._stranded:
            return  # their staging memory still holds the only copy
        self._stranded_plan = None
        plan.staging.release(plan.batches, in_use_on=None)  # the synchronize above ordered everything
