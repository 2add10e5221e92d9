"""The order of a step's stages, batch by batch (``BatchWalk``), on recording stages and staging.

The simulator's tests prove each wait on real data; these pin the order the walk issues the stages in, which a
caller driving the walk one batch at a time relies on: a batch's copy-in is issued while the batch before it
updates, its copy-out right after its update, the resident parameters before the first wait for a copy-in.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from swap_core.backends.protocol import Event, Stream
from swap_core.runtime.batch_walk import BatchWalk, UpdateFn
from swap_core.runtime.plan import PlannedBatch, SwapPlan
from swap_core.runtime.staging import Offloaded, StagingWalk
from swap_core.stats import SwapStats


class _Event:
    """A stand-in event, named after the stage that recorded it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""


class _RecordingStages:
    """Stages that record what they were asked to do, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.waited_for: dict[int, str | None] = {}

    def prefetch_batch(self, batch: PlannedBatch, stats: SwapStats, *, reused: Offloaded | None = None) -> Event:
        self.calls.append(f"in {batch.index}")
        self.waited_for[batch.index] = None if reused is None else reused.done.name  # type: ignore[attr-defined]
        return _Event(f"in {batch.index}")

    def update_batch(self, batch: PlannedBatch, prefetched: Event, update: UpdateFn) -> None:
        assert prefetched.name == f"in {batch.index}"  # type: ignore[attr-defined]
        self.calls.append(f"update {batch.index}")

    def offload_batch(self, batch: PlannedBatch, stats: SwapStats, *, to_spare: bool = False) -> Offloaded:
        self.calls.append(f"out {batch.index}")
        event = _Event(f"out {batch.index}")
        return Offloaded(event, event)

    def update_resident(self, resident: PlannedBatch, update: UpdateFn) -> None:
        self.calls.append("update resident")


class _AlternatingStaging:
    """Two memories taken in turn (the arenas): batch ``i`` reuses batch ``i - 2``'s."""

    def __init__(self, batches: Sequence[PlannedBatch], *, shared_by: frozenset[tuple[int, int]]) -> None:
        self._batches, self._shared_by = batches, shared_by
        self._last_out_of: dict[int, Offloaded] = {}

    def before_copy_in(self, position: int) -> Offloaded | None:
        return self._last_out_of.get(position % 2)

    def copied_out(self, position: int, offloaded: Offloaded) -> None:
        self._last_out_of[position % 2] = offloaded

    def needs_memory_of(self, position: int, earlier: int) -> bool:
        return (position, earlier) in self._shared_by


class _Staging:
    def __init__(self, shared_by: frozenset[tuple[int, int]] = frozenset()) -> None:
        self._shared_by = shared_by

    @property
    def peak_bytes(self) -> int:
        return 0

    def acquire(self) -> None:
        """Nothing."""

    def walk(self, batches: Sequence[PlannedBatch], compute: Stream) -> StagingWalk:
        return _AlternatingStaging(batches, shared_by=self._shared_by)

    def release(self, batches: Sequence[PlannedBatch], *, in_use_on: Stream | None) -> None:
        """Nothing."""

    def release_after_walk(self, batches: Sequence[PlannedBatch], *, in_use_on: Stream, keep: bool) -> None:
        """Nothing."""


def _plan(count: int, *, resident: bool, shared_by: frozenset[tuple[int, int]] = frozenset()) -> SwapPlan:
    batches = [PlannedBatch(index, [(0, torch.zeros(1))], [], 4) for index in range(count)]
    resident_batch = PlannedBatch(-1, [(0, torch.zeros(1))], [], 0) if resident else None
    return SwapPlan(batches, _Staging(shared_by), version=0, resident=resident_batch)


def _walk(plan: SwapPlan, *, prefetched: bool = False) -> tuple[_RecordingStages, list[int | None]]:
    stages = _RecordingStages()
    walk = BatchWalk(
        stages,
        plan,
        plan.batches,
        object(),  # the compute stream, which the recording staging ignores
        lambda batch: None,
        SwapStats(),
        prefetched=_Event("in 0") if prefetched else None,
    )
    order: list[int | None] = []
    while not walk.done:
        next_batch = walk.next_batch
        order.append(None if next_batch is None else next_batch.index)
        walk.advance()
    assert walk.next_batch is None and walk.last_offload is not None
    assert walk.last_offload.done.name == f"out {len(plan.batches) - 1}"  # type: ignore[attr-defined]
    return stages, order


def test_each_copy_in_is_issued_while_the_batch_before_updates_and_each_copy_out_after_its_update() -> None:
    stages, order = _walk(_plan(3, resident=False))
    assert order == [0, 1, 2]
    assert stages.calls == ["in 0", "in 1", "update 0", "out 0", "in 2", "update 1", "out 1", "update 2", "out 2"]
    # The copy-in of batch 2 takes batch 0's memory: it waits for batch 0's copy-out.
    assert stages.waited_for == {0: None, 1: None, 2: "out 0"}


@pytest.mark.parametrize("prefetched", [False, True], ids=["copied_in_by_the_step", "prefetched"])
def test_the_resident_parameters_update_before_the_first_wait_for_a_copy_in(prefetched: bool) -> None:
    """Batch 0's copy-in is waited for at its update, unless ``prefetch()`` issued it before the step: then the
    first wait is for batch 1's, and the resident parameters go after batch 0."""
    stages, _ = _walk(_plan(3, resident=True), prefetched=prefetched)
    if prefetched:
        assert stages.calls[:5] == ["in 1", "update 0", "out 0", "in 2", "update resident"]
    else:
        assert stages.calls[:4] == ["in 0", "in 1", "update resident", "update 0"]


def test_a_batch_that_needs_the_memory_of_the_one_before_comes_in_after_its_copy_out() -> None:
    """Batches skipped between them put two batches of one arena next to each other in the walk."""
    stages, _ = _walk(_plan(3, resident=False, shared_by=frozenset({(1, 0)})))
    assert stages.calls[:5] == ["in 0", "update 0", "out 0", "in 1", "in 2"]
