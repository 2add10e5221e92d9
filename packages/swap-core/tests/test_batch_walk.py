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
    """``memories`` memories taken in turn (the arenas): batch ``i`` reuses batch ``i - memories``'s, and the pairs
    ``shared_by`` share one too (batches skipped between them)."""

    def __init__(self, memories: int, *, shared_by: frozenset[tuple[int, int]]) -> None:
        self._memories, self._shared_by = memories, shared_by
        self._last_out_of: dict[int, Offloaded] = {}

    def before_copy_in(self, position: int) -> Offloaded | None:
        return self._last_out_of.get(position % self._memories)

    def copied_out(self, position: int, offloaded: Offloaded) -> None:
        self._last_out_of[position % self._memories] = offloaded

    def needs_memory_of(self, position: int, earlier: int) -> bool:
        return (position - earlier) % self._memories == 0 or (position, earlier) in self._shared_by


class _Staging:
    def __init__(self, shared_by: frozenset[tuple[int, int]] = frozenset(), memories: int = 2) -> None:
        self._shared_by, self._memories = shared_by, memories

    @property
    def peak_bytes(self) -> int:
        return 0

    def acquire(self) -> None:
        """Nothing."""

    def walk(self, batches: Sequence[PlannedBatch], compute: Stream) -> StagingWalk:
        return _AlternatingStaging(self._memories, shared_by=self._shared_by)

    def release(self, batches: Sequence[PlannedBatch], *, in_use_on: Stream | None) -> None:
        """Nothing."""

    def release_after_walk(self, batches: Sequence[PlannedBatch], *, in_use_on: Stream) -> bool:
        """Nothing, and nothing kept."""
        return False


def _plan(
    count: int, *, resident: bool, shared_by: frozenset[tuple[int, int]] = frozenset(), memories: int = 2
) -> SwapPlan:
    batches = [PlannedBatch(index, [(0, torch.zeros(1))], [], 4) for index in range(count)]
    resident_batch = PlannedBatch(-1, [(0, torch.zeros(1))], [], 0) if resident else None
    return SwapPlan(batches, _Staging(shared_by, memories), version=0, resident=resident_batch)


def _walk(plan: SwapPlan, *, prefetched: int = 0) -> tuple[_RecordingStages, list[int | None]]:
    """Walk ``plan`` on recording stages, its first ``prefetched`` batches copied in before it."""
    stages = _RecordingStages()
    walk = BatchWalk(
        stages,
        plan,
        plan.batches,
        object(),  # the compute stream, which the recording staging ignores
        lambda batch: None,
        SwapStats(),
        prefetched=[_Event(f"in {index}") for index in range(prefetched)],
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
    stages, _ = _walk(_plan(3, resident=True), prefetched=1 if prefetched else 0)
    if prefetched:
        assert stages.calls[:5] == ["in 1", "update 0", "out 0", "in 2", "update resident"]
    else:
        assert stages.calls[:4] == ["in 0", "in 1", "update resident", "update 0"]


def test_a_batch_that_needs_the_memory_of_the_one_before_comes_in_after_its_copy_out() -> None:
    """Batches skipped between them put two batches of one arena next to each other in the walk."""
    stages, _ = _walk(_plan(3, resident=False, shared_by=frozenset({(1, 0)})))
    assert stages.calls[:5] == ["in 0", "update 0", "out 0", "in 1", "in 2"]


def test_batches_the_prefetch_copied_in_come_in_once_and_the_next_comes_in_while_the_last_of_them_updates() -> None:
    """Three memories, the prefetch before the step copied batches 0 and 1 in: the walk copies neither again, batch
    2 (a memory of its own) comes in while batch 1 updates, and batch 3 takes batch 0's memory once it is copied
    out; the resident parameters wait for batch 2's copy-in, the first one the step issues."""
    stages, order = _walk(_plan(5, resident=True, memories=3), prefetched=2)
    assert order == [0, 1, 2, 3, 4]
    assert stages.calls == [
        *("update 0", "out 0", "in 2", "update 1", "out 1", "in 3", "update resident", "update 2", "out 2"),
        *("in 4", "update 3", "out 3", "update 4", "out 4"),
    ]
    assert stages.waited_for == {2: None, 3: "out 0", 4: "out 1"}


def test_the_copy_in_after_next_is_issued_with_the_copy_out_not_at_the_next_advance() -> None:
    """Inside the backward each ``advance()`` is a gradient hook, and the next one may come much later: the copy-in
    of the batch after the next one is issued right after this batch's copy-out (in stream order it waits for that
    copy-out only where it takes its memory), so the link does not idle until the backward reaches the next batch."""
    stages = _RecordingStages()
    plan = _plan(4, resident=False)
    walk = BatchWalk(stages, plan, plan.batches, object(), lambda batch: None, SwapStats())
    issued = [list(stages.calls)]
    while not walk.done:
        before = len(stages.calls)
        walk.advance()
        issued.append(stages.calls[before:])
    assert issued == [
        ["in 0"],
        ["in 1", "update 0", "out 0", "in 2"],
        ["update 1", "out 1", "in 3"],
        ["update 2", "out 2"],
        ["update 3", "out 3"],
    ]
    assert stages.waited_for == {0: None, 1: None, 2: "out 0", 3: "out 1"}
