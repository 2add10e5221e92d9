"""The swap pipeline: prefetch batch ``i + 1`` while batch ``i`` updates, offload behind it.

::

    h2d      [b0][b1]     [b2]      ...
    compute  [res][upd b0] [upd b1]  [upd b2]
    d2h                    [b0]      [b1]     [b2]

``res``: the plan's resident parameters (no swapped state) update first, while batch 0 comes in; after batch 0's
update, while batch 1 comes in, when :meth:`PipelineScheduler.prefetch` brought batch 0 before the step.

Every cross-stream dependency is an explicit event; the scheduler never blocks
the host during a step. A step's compute stream is the stream current when it
starts (``with torch.cuda.stream(s): opt.step()`` updates on ``s``, as a plain
optimizer would); staging memory is freed behind the last stream that used it
(``release_storage(..., in_use_on=...)``), whichever stream allocated it.
After a step the last offload may still be running:
:meth:`PipelineScheduler.synchronize` waits for it before anyone reads host
mirrors, and the next step's prefetch stream waits for it on the device.

Packed mode stages batches in turn in its arenas (two by default), so batch
``i + 1`` may only be copied into the arena batch ``i - 1`` used (with two) once
that batch's offload finished reading it: half by half (the copies are cut at the arena's middle),
so that the copy-in of the first half overlaps the copy-out of the second.
Waiting for the whole offload instead would idle the copy-in stream for half an
update per batch (6% of a step at 16 batches on PCIe 4, on the virtual clock).
Per-tensor mode restores each state's own storage one batch ahead and releases
it once its offload is done. Which of the two a plan has is its
:class:`~swap_core.runtime.staging.Staging`, chosen once when the plan is built;
the scheduler walks either through the same calls.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

from ..backends.protocol import DeviceBackend, Event, Stream
from ..errors import SwapStateError
from ..nesting import NestedFlag
from ..stats import SwapStats
from ..torch_compat import profiler_enabled
from ..trace import StepTrace, TraceInterval
from .batch_walk import BatchWalk, UpdateFn
from .plan import PlannedBatch, SwapPlan
from .slots import SlotState, SwapSlot, transition
from .staging import Offloaded, StagingWalk
from .walk_ends import WalkEnds

__all__ = ["Offloaded", "PipelineScheduler", "UpdateFn", "drain_in_flight_copies"]

_LOG = logging.getLogger("swap_core")


class PipelineScheduler(WalkEnds):
    """Runs one step's transfers and updates on the backend's streams.

    A step is a walk: :meth:`begin`, :meth:`advance` for each batch (all at once, or as a backward makes them ready),
    :meth:`end`. Each batch goes through four stages, one method each (:meth:`prefetch_batch`,
    :meth:`update_batch`, :meth:`offload_batch`, and :meth:`update_resident` for the resident part): the
    simulator's planted-bug tests replace one stage to prove that a missing or an extra wait fails a test. A walk
    that fails, or is ended where it is, ends as :class:`~swap_core.runtime.walk_ends.WalkEnds` says.
    """

    def __init__(self, backend: DeviceBackend, *, duplex: bool) -> None:
        self.backend = backend
        self.compute = backend.compute_stream()
        """The stream the current (or last) step or prefetch issued its compute and allocations to."""
        self.h2d = backend.new_stream()
        self.d2h = backend.new_stream() if duplex else self.h2d
        self._last_offload: Event | None = None
        self._offloads: dict[int, Event] = {}
        """The copy-out of each batch of the walk under way or last run (by batch index)."""
        self._earlier_offloads: dict[int, Event] = {}
        """Copy-outs of earlier steps of the same plan that a copy-in of their batch has not waited for yet."""
        self._staging_kept = False
        self._in_flight: SwapPlan | None = None
        """The plan whose last offloads may still be running: it keeps their host buffers alive until the host has
        waited for them (:meth:`synchronize`), whatever else lets go of them (see :func:`drain_in_flight_copies`)."""
        self._offloaded: list[SwapSlot] = []
        self._stranded: list[PlannedBatch] = []
        self._stranded_plan: SwapPlan | None = None
        self._timeline: _Timeline | None = None
        self._early: _EarlyPrefetch | None = None
        self._working = NestedFlag()
        self._open_walk: bool | None = None
        """Whether a walk begun by :meth:`begin` awaits :meth:`end` (inside a backward, between two hooks): ``None``
        when none does, else whether it is provisional. The walk itself is its driver's: held here, it would keep the
        optimizer alive through its update (a finalizer holds the scheduler)."""
        self.take_back_for_the_host: Callable[[], None] | None = None
        """Called when the host is about to read or write the host mirrors (a user reads ``state``) while a
        provisional walk is open: its driver takes the step back, so that the read sees the state before the step
        (step counters and resident states too) and an edit is one of it; ``step()`` then runs after the backward."""

    def prefetch(self, plan: SwapPlan) -> None:
        """Start ``plan``'s first copy-ins now, before the step that runs ``plan`` (nothing if some are pending): as
        many batches as leave the staging memory room for the next one, which the step copies in while the first
        updates (one batch with two staging buffers, ``k - 1`` with ``k``).

        The step then waits for them instead of issuing them; a step that runs another plan (the state or
        the param groups changed meanwhile) first drops them. If an enqueue fails, nothing is pending.
        """
        if self._early is not None or not plan.batches or self._open_walk is not None:
            return
        self.compute = self.backend.compute_stream()
        self._settle(plan)
        plan.staging.acquire()
        counted = SwapStats()
        staging = plan.staging.walk(plan.batches, self.compute)
        events: list[Event] = []
        try:
            for position in range(_early_batches(plan, staging)):
                reused = staging.before_copy_in(position)
                events.append(self.prefetch_batch(plan.batches[position], counted, reused=reused))
        except BaseException:
            self._drop_early(_EarlyPrefetch(plan, events, counted.h2d_copies, counted.h2d_bytes), failed=True)
            raise
        self._early = _EarlyPrefetch(plan, events, counted.h2d_copies, counted.h2d_bytes)

    def begin(
        self,
        plan: SwapPlan,
        update: UpdateFn,
        stats: SwapStats,
        *,
        skip: frozenset[int] = frozenset(),
        traced: bool = False,
        provisional: bool = False,
        on_copy_in: UpdateFn | None = None,
    ) -> BatchWalk:
        """Begin a step over ``plan``: batch 0's copy-in is issued now, unless a pending :meth:`prefetch` of ``plan``
        issued it (one of another plan is dropped). The caller advances the walk batch by batch (:meth:`advance`)
        and ends it with :meth:`end`, on the stream current now whatever stream it runs under then.

        ``skip``: indices of batches that have nothing to update (no parameter of theirs has a gradient): they are
        not copied at all (a batch 0 that :meth:`prefetch` already copied in runs anyway). ``traced``: the phases
        are timed from now, for :meth:`end`'s ``trace``. ``provisional``: the updates may be taken back: each batch
        is copied out to its states' spare host copies (the mirrors stay as they were), a failure drops the device
        copies instead of copying them out, and :meth:`abandon` ends the walk without a trace of it on the host.
        """
        self.compute = self.backend.compute_stream()
        self._timeline = _Timeline(self.backend, self.compute) if traced else None
        early = self._take_early(plan)
        self._settle(plan)
        prefetched = 0 if early is None else len(early.events)
        batches = [batch for batch in plan.batches if batch.index not in skip or batch.index < prefetched]
        with self._recover_on_error(plan, provisional=provisional):
            if batches:
                plan.staging.acquire()
            walk = BatchWalk(
                self,
                plan,
                batches,
                self.compute,
                update,
                stats,
                prefetched=_counted(early, stats),
                to_spare=provisional,
                on_copy_in=on_copy_in,
            )
        self._open_walk = provisional
        return walk

    def advance(self, walk: BatchWalk) -> None:
        """Update ``walk``'s next batch (issuing the copies around it) on the stream the walk began on."""
        with self._recover_on_error(walk.plan, provisional=walk.to_spare), self.backend.stream(self.compute):
            walk.advance()

    def end(self, walk: BatchWalk, *, trace: StepTrace | None = None) -> None:
        """The batches ``walk`` has left, then the end of the step: the last copy-outs run on behind the caller
        (:meth:`synchronize` waits for them) and free their staging behind them (timed into ``trace`` when the
        walk began ``traced``)."""
        self._open_walk = None
        plan = walk.plan
        with self._recover_on_error(plan, provisional=walk.to_spare), self.backend.stream(self.compute):
            while not walk.done:
                walk.advance()
            if walk.last_offload is not None:
                self._last_offload = walk.last_offload.done
                self._in_flight = plan
                # The last offloads still read their staging memory: freed stream-ordered behind them, so that the
                # compute stream (the next forward) does not wait for them.
                self._staging_kept = plan.staging.release_after_walk(walk.batches, in_use_on=self.d2h)
        walk.stats.batches = len(walk.batches)
        self._finish_trace(trace)

    def _finish_trace(self, trace: StepTrace | None) -> None:
        if trace is not None and self._timeline is not None:
            trace.intervals.extend(self._timeline.intervals())
        self._timeline = None

    @property
    def prefetched(self) -> bool:
        """Whether a :meth:`prefetch` is pending (the next step's first copy-in is issued)."""
        return self._early is not None

    def working(self) -> contextlib.AbstractContextManager[None]:
        """The optimizer's own work (a step, a prefetch): its reads of the state need no :meth:`settle_for_host`."""
        return self._working.raised()

    def settle_for_host(self) -> None:
        """Outside the optimizer's own work, the host is about to read or write host mirrors (a user reads
        ``opt.state``): the copies in flight finish first, and a pending prefetch, which copied the mirrors as they
        were, is dropped (the step copies them again). Nothing happens when nothing is in flight. A provisional walk
        still open is taken back first (:attr:`take_back_for_the_host`)."""
        self._take_back_for_the_host()
        if self._working or (self._last_offload is None and self._early is None and self._stranded_plan is None):
            self._refuse_while_walking()
            return
        self.synchronize()
        self.discard_prefetch()

    def synchronize(self) -> None:
        """Block until every offload (and a pending prefetch's copy-in) finished, so host mirrors may be read
        and written. Refused while a walk begun by :meth:`begin` awaits its end, outside the optimizer's
        own work: its batches are half updated (a provisional walk is taken back first, see
        :meth:`settle_for_host`)."""
        self._take_back_for_the_host()
        self._refuse_while_walking()
        if self._early is not None:
            self._early.events[-1].synchronize()  # the last copy-in of the stream that issued them all
        self._retry_stranded(final=True)
        if self._last_offload is not None:
            self._last_offload.synchronize()
            self._last_offload = None
        self._offloads, self._earlier_offloads = {}, {}
        self._in_flight = None
        self._finish_offloads()

    def _take_back_for_the_host(self) -> None:
        take_back = self.take_back_for_the_host
        if self._open_walk and not self._working and take_back is not None:
            with self.working():
                take_back()

    def _refuse_while_walking(self) -> None:
        if self._open_walk is not None and not self._working:
            raise SwapStateError(
                "The optimizer's states are being updated inside the backward (SwapConfig(step='in_backward')), some "
                "batches already stepped: call step() before reading, saving or editing them"
            )

    # -- the three moves ------------------------------------------------------
    def prefetch_batch(self, batch: PlannedBatch, stats: SwapStats, *, reused: Offloaded | None = None) -> Event:
        """Copy ``batch`` in, its staging memory ready (:meth:`~swap_core.runtime.staging.StagingWalk.before_copy_in`);
        ``reused``: the offload of the batch whose arena it takes, waited for half by half."""
        with _profiler_range("swap::prefetch"):
            # Fresh device memory belongs to the compute stream until the copy stream waits for it.
            self._after_compute(self.h2d)
            earlier = self._earlier_offloads.pop(batch.index, None)
            if earlier is not None:  # its host mirror is written by an earlier step's copy-out
                self.backend.wait_event(self.h2d, earlier)
            started = self._mark(self.h2d)
            nbytes = 0
            for position, (host, device) in enumerate(batch.transfers):
                if reused is not None and position in (0, batch.front_transfers):
                    # Each half of the arena once the offload read that half.
                    self.backend.wait_event(self.h2d, reused.front if position < batch.front_transfers else reused.done)
                self.backend.copy(device, host, stream=self.h2d)
                nbytes += host.numel() * host.element_size()
            stats.count("h2d", len(batch.transfers), nbytes)
            transition(batch.slots, SlotState.HOST, SlotState.H2D)
            self._span(batch, "h2d", started, self.h2d, nbytes)
            return self.backend.record_event(self.h2d)

    def update_batch(self, batch: PlannedBatch, prefetched: Event, update: UpdateFn) -> None:
        """Update ``batch`` on the compute stream once its copy-in (``prefetched``) has landed."""
        self.backend.wait_event(self.compute, prefetched)
        transition(batch.slots, SlotState.H2D, SlotState.DEVICE)
        started = self._mark(self.compute)
        with _profiler_range("swap::update"), self.backend.compute_scope():
            update(batch)
        self._span(batch, "update", started, self.compute, 0)

    def update_resident(self, resident: PlannedBatch, update: UpdateFn) -> None:
        """The parameters without swapped states: nothing to wait for, so they go first on the compute stream."""
        started = self._mark(self.compute)
        with _profiler_range("swap::update"), self.backend.compute_scope():
            update(resident)
        self._span(resident, "update", started, self.compute, 0)

    def offload_batch(self, batch: PlannedBatch, stats: SwapStats, *, to_spare: bool = False) -> Offloaded:
        """Copy ``batch``'s updated states out to their host mirrors (``to_spare``: to their spare copies), after its
        update on the compute stream."""
        with _profiler_range("swap::offload"):
            self._after_compute(self.d2h)
            started = self._mark(self.d2h)
            nbytes = 0
            front: Event | None = None
            transfers = batch.spare_transfers if to_spare else batch.transfers
            if len(transfers) != len(batch.transfers):
                raise SwapStateError(f"Batch {batch.index} has no spare host copy to copy out to (a provisional walk)")
            for position, (host, device) in enumerate(transfers):
                if position == batch.front_transfers:
                    front = self.backend.record_event(self.d2h)
                self.backend.copy(host, device, stream=self.d2h)
                nbytes += host.numel() * host.element_size()
            stats.count("d2h", len(batch.transfers), nbytes)  # as many to the spare copies
            # Only once every copy is enqueued: a failed enqueue leaves the device copy authoritative.
            transition(batch.slots, SlotState.DEVICE, SlotState.D2H)
            self._offloaded.extend(batch.slots)
            self._span(batch, "d2h", started, self.d2h, nbytes)
            done = self.backend.record_event(self.d2h)
            self._offloads[batch.index] = done
            return Offloaded(front if front is not None else done, done)

    def _mark(self, stream: Stream) -> Event | None:
        return self._timeline.mark(stream) if self._timeline is not None else None

    def _span(self, batch: PlannedBatch, phase: str, started: Event | None, stream: Stream, nbytes: int) -> None:
        if self._timeline is not None and started is not None:
            self._timeline.span(batch.index, phase, started, stream, nbytes)

    def _after_compute(self, stream: Stream) -> None:
        self.backend.wait_event(stream, self.backend.record_event(self.compute))

    # -- an early prefetch ---------------------------------------------------------
    def discard_prefetch(self) -> None:
        """Drop a pending :meth:`prefetch` (host states are about to change outside a step): its staging is freed."""
        early, self._early = self._early, None
        if early is not None:
            self._drop_early(early)

    def _take_early(self, plan: SwapPlan) -> _EarlyPrefetch | None:
        """The pending prefetch of ``plan``'s first batches, or ``None``; one of another plan is dropped."""
        early, self._early = self._early, None
        if early is None or early.plan is plan:
            return early
        self._drop_early(early)
        return None

    def _drop_early(self, early: _EarlyPrefetch, *, failed: bool = False) -> None:
        """The batches ``early`` copied in are back on the host (their mirrors never changed), their staging memory
        freed behind the copy-ins. ``failed``: an enqueue of the batch after them failed: the host waits for the
        copies issued (a copy-in reads the mirrors the host may write once nothing is pending)."""
        if failed:
            with contextlib.suppress(Exception):  # the enqueue's own error is the one raised
                self.backend.record_event(self.h2d).synchronize()
        copied = early.plan.batches[: len(early.events)]
        for batch in copied:
            transition(batch.slots, SlotState.H2D, SlotState.HOST)
        issued = len(early.events) + (1 if failed else 0)  # a failed batch may hold its memory
        early.plan.staging.release(early.plan.batches[:issued], in_use_on=self.h2d)

    # -- between steps --------------------------------------------------------
    def _settle(self, plan: SwapPlan) -> None:
        """Order this step's copy-ins after the previous step's offloads: each after its own batch's, when ``plan``
        is the plan of those offloads and their staging was released (a copy-in then overwrites no memory another
        copy-out reads but its batch's host mirror); else all after the last one."""
        self._retry_stranded(final=True)
        if self._offloads and plan is self._in_flight and not self._staging_kept:
            self._earlier_offloads.update(self._offloads)
        elif self._last_offload is not None:
            self.backend.wait_event(self.h2d, self._last_offload)
            self._earlier_offloads = {}
        self._offloads = {}
        self._finish_offloads()

    def _finish_offloads(self) -> None:
        transition(self._offloaded, SlotState.D2H, SlotState.HOST)
        self._offloaded = []


def drain_in_flight_copies(scheduler: PipelineScheduler) -> None:
    """Finalizer of a swapped optimizer: wait for the copies it left in flight before its host buffers go.

    Registered with ``weakref.finalize(optimizer, drain_in_flight_copies, scheduler)``: the finalizer holds
    the scheduler, whose in-flight plan holds the host buffers the last offload writes, so they outlive the
    optimizer until this ran (``opt.step(); del opt`` would otherwise unregister and unmap exact-size pinned
    buffers that a device-to-host copy is still writing). A failure cannot be raised from a finalizer: it is
    logged.
    """
    try:
        scheduler.synchronize()
    except Exception as error:
        _LOG.warning("Could not wait for the copies of a collected swapped optimizer (%s)", error)


class _EarlyPrefetch:
    """The first batches of ``plan`` copied in by :meth:`PipelineScheduler.prefetch` before its step (``events``:
    each one's copy-in, in walk order; ``copies``, ``nbytes``: all of theirs)."""

    __slots__ = ("copies", "events", "nbytes", "plan")

    def __init__(self, plan: SwapPlan, events: list[Event], copies: int, nbytes: int) -> None:
        self.plan = plan
        self.events = events
        self.copies = copies
        self.nbytes = nbytes


def _profiler_range(name: str) -> contextlib.AbstractContextManager[object]:
    """``record_function(name)`` while a torch profiler runs; nothing otherwise.

    An idle ``record_function`` still costs tens of microseconds (an op dispatch on enter and exit),
    and a step opens three per batch. torch's own code (dynamo) reads the same flag, which every
    profiler (``torch.profiler.profile``, ``emit_nvtx``, ``emit_itt``) sets while it runs.
    """
    if profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class _Timeline:
    """Timing events of one traced step, turned into intervals once the step's work is done."""

    def __init__(self, backend: DeviceBackend, compute: Stream) -> None:
        self._backend = backend
        self._origin = backend.record_event(compute, timing=True)
        self._spans: list[tuple[int, str, Event, Event, int]] = []

    def mark(self, stream: Stream) -> Event:
        return self._backend.record_event(stream, timing=True)

    def span(self, batch: int, phase: str, started: Event, stream: Stream, nbytes: int) -> None:
        self._spans.append((batch, phase, started, self.mark(stream), nbytes))

    def intervals(self) -> list[TraceInterval]:
        elapsed = self._backend.elapsed_seconds
        return [
            TraceInterval(batch, phase, elapsed(self._origin, start), elapsed(self._origin, end), nbytes)
            for batch, phase, start, end, nbytes in self._spans
        ]


def _early_batches(plan: SwapPlan, staging: StagingWalk) -> int:
    """How many of ``plan``'s first batches (it has one at least) :meth:`PipelineScheduler.prefetch` copies in: the
    first, then each batch whose memory is none of the batches' before it, while the batch after it would still find
    memory of its own beside them."""

    def fits(position: int) -> bool:
        return not any(staging.needs_memory_of(position, earlier) for earlier in range(position))

    count = 1
    while count < len(plan.batches) and fits(count) and (count + 1 == len(plan.batches) or fits(count + 1)):
        count += 1
    return count


def _counted(early: _EarlyPrefetch | None, stats: SwapStats) -> list[Event]:
    """The events of the first batches' copy-ins that :meth:`PipelineScheduler.prefetch` issued (their copies
    counted into ``stats`` now, in the step they serve); none without one."""
    if early is None:
        return []
    stats.count("h2d", early.copies, early.nbytes)
    return early.events
