"""One step's walk over its batches, a batch at a time: copy-in ahead, update, copy-out behind.

:class:`BatchWalk` issues batch ``i + 1``'s copy-in while batch ``i`` updates, then batch ``i``'s copy-out, and
right after it batch ``i + 2``'s copy-in where that batch's memory is free by then (its copy-in waits for the copy-out
whose memory it takes on the device, not for the walk to reach batch ``i + 1``: inside the backward that is the next
gradient hook); the plan's resident parameters update while the first wait for a copy-in would stall the compute
stream. It runs the stages of a :class:`Stages` (the :class:`~swap_core.runtime.pipeline.PipelineScheduler`'s, which the
simulator's planted-bug tests replace one at a time) and asks the plan's :class:`~swap_core.runtime.staging.Staging`
where each batch's memory comes from. :meth:`BatchWalk.advance` takes one batch, so a caller can walk the step in one go
or batch by batch as the batches become ready (``PipelineScheduler.begin``, ``advance``, ``end``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ..backends.protocol import Event, Stream
from ..stats import SwapStats
from .plan import PlannedBatch, SwapPlan
from .staging import Offloaded

__all__ = ["BatchWalk", "Stages", "UpdateFn"]

UpdateFn = Callable[[PlannedBatch], None]


class Stages(Protocol):
    """The four stages of a batch (see :class:`~swap_core.runtime.pipeline.PipelineScheduler`)."""

    def prefetch_batch(self, batch: PlannedBatch, stats: SwapStats, *, reused: Offloaded | None = None) -> Event: ...

    def update_batch(self, batch: PlannedBatch, prefetched: Event, update: UpdateFn) -> None: ...

    def offload_batch(self, batch: PlannedBatch, stats: SwapStats, *, to_spare: bool = False) -> Offloaded: ...

    def update_resident(self, resident: PlannedBatch, update: UpdateFn) -> None: ...


class BatchWalk:
    """The walk of one step over ``batches`` (``plan``'s, those with something to update, in walk order).

    ``prefetched``: the events of the first batches' copy-ins that :meth:`PipelineScheduler.prefetch` issued before the
    step (their copies already counted in ``stats``); without any, batch 0 is copied in now. ``to_spare``: the updates
    are provisional: each batch is copied out to its states' spare host copies, the mirrors stay as they were, and the
    last batch's copy-out is held until the walk ends (:meth:`advance` once more): a walk taken back instead never
    issues it, so the step that runs again finds that batch's staging memory free once its update is done, not once a
    copy nobody reads is.
    """

    def __init__(
        self,
        stages: Stages,
        plan: SwapPlan,
        batches: Sequence[PlannedBatch],
        compute: Stream,
        update: UpdateFn,
        stats: SwapStats,
        *,
        prefetched: Sequence[Event] = (),
        to_spare: bool = False,
        on_copy_in: UpdateFn | None = None,
    ) -> None:
        self._stages, self.plan, self.batches = stages, plan, batches
        self.to_spare = to_spare
        self._on_copy_in = on_copy_in
        self._update, self.stats = update, stats
        self._resident = plan.resident
        """The plan's resident batch until it updated (a walk without swapped batches is that update alone)."""
        self._staging = plan.staging.walk(batches, compute)
        self._prefetched: dict[int, Event] = dict(enumerate(prefetched))
        """The copy-in of each batch issued and not yet updated, by position."""
        self._position = 0
        self._next_in = len(prefetched)
        """The position of the next batch to copy in (those before it are issued)."""
        self.last_offload: Offloaded | None = None
        """The copy-out of the last batch walked (``None`` before the first)."""
        self._held: int | None = None
        """The position of the last batch of a provisional walk, updated, its copy-out held (see the class)."""
        # The first wait of the compute stream for a copy-in: batch 0's, or the first one's the prefetch did not issue.
        self._resident_at = len(prefetched) if len(prefetched) < len(batches) else 0
        if on_copy_in is not None:
            for batch in batches[: len(prefetched)]:
                on_copy_in(batch)
        if batches and not prefetched:
            self._prefetch(0)
            self._next_in = 1

    @property
    def done(self) -> bool:
        """Whether every batch was updated and its copy-out issued (and the resident batch updated)."""
        return self._position == len(self.batches) and self._resident is None and self._held is None

    @property
    def next_batch(self) -> PlannedBatch | None:
        """The swapped batch :meth:`advance` updates next (``None`` when none is left)."""
        return self.batches[self._position] if self._position < len(self.batches) else None

    def advance(self) -> None:
        """Update the next batch and issue its copy-out; the batch after it comes in while it updates, unless it
        needs this one's memory (batches skipped between them): then it comes in once this one is copied out. After
        the copy-out, the batch after that comes in too if its memory is not the batch's updating next. Once every
        batch updated, the copy-out held (a provisional walk's last) is issued."""
        if self._held is not None:
            held, self._held = self._held, None
            self._copy_out(held)
            return
        position, batches, stages = self._position, self.batches, self._stages
        if position == self._resident_at and self._resident is not None:
            resident, self._resident = self._resident, None
            if not batches:  # nothing swapped has a gradient: the resident batch is the whole step
                stages.update_resident(resident, self._update)
                return
        else:
            resident = None
        batch = batches[position]
        self._copy_in_ahead(updating=position)
        if resident is not None:
            stages.update_resident(resident, self._update)  # the compute stream would wait for a copy-in
        stages.update_batch(batch, self._prefetched.pop(position), self._update)
        if self._holds_copy_out(last=position + 1 == len(batches)):
            self._held = position
        else:
            self._copy_out(position)
        self._position += 1
        self._copy_in_ahead(updating=self._position)

    def _copy_in_ahead(self, *, updating: int) -> None:
        """Issue the copy-ins after the last one issued, in walk order, up to the batch after ``updating`` (the one
        updating now or next), each unless it needs the memory of a batch from ``updating`` on (not yet copied out)."""
        batches, staging = self.batches, self._staging
        while self._next_in < min(len(batches), updating + 2) and not any(
            staging.needs_memory_of(self._next_in, held) for held in range(updating, self._next_in)
        ):
            self._prefetch(self._next_in)
            self._next_in += 1

    def _holds_copy_out(self, *, last: bool) -> bool:
        """Whether the batch just updated (``last``: the walk's last) keeps its copy-out for the walk's end: a
        provisional walk's last."""
        return self.to_spare and last

    def _copy_out(self, position: int) -> None:
        self.last_offload = self._stages.offload_batch(self.batches[position], self.stats, to_spare=self.to_spare)
        self._staging.copied_out(position, self.last_offload)

    def _prefetch(self, position: int) -> None:
        reused = self._staging.before_copy_in(position)
        self._prefetched[position] = self._stages.prefetch_batch(self.batches[position], self.stats, reused=reused)
        if self._on_copy_in is not None:
            self._on_copy_in(self.batches[position])
