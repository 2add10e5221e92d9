"""Planted bugs in the pipeline and observations of it, for tests that prove a check catches what it is for.

A clock or race test is only worth its goal if breaking the mechanism fails it. Each context manager here breaks one
rule of swap-core's pipeline for the duration of its block (an extra wait, a missing overlap), so that a suite of
another package (swap-bench's modeled iteration, say) can plant it without reaching into swap-core's private
names::

    from swap_core.testing import planted

    with planted.updates_held_back_to_step():
        row = model_iteration(spec)        # every batch now updates in step(): the goal must fail
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

from ..optimizer import plan_cache
from ..optimizer.in_backward import driver as in_backward_driver
from ..runtime import packed
from ..runtime.batch_walk import BatchWalk
from ..runtime.pipeline import PipelineScheduler
from ..runtime.plan import build_plan
from ..runtime.staging import ArenaStaging, Offloaded, StagingWalk
from ..runtime.update_undo import UpdateUndo

__all__ = [
    "TAKE_BACK_PARTS",
    "commit_check_fails",
    "commits_without_the_check",
    "copy_ins_issued_after_the_copy_out_before",
    "copy_ins_wait_for_the_copy_out",
    "packed_host_in_one_buffer_per_dtype",
    "plans_built",
    "provisional_copy_outs_not_held",
    "take_back_misses",
    "updates_held_back_to_step",
]

TAKE_BACK_PARTS = ("swapped_states", "resident_states", "params", "masters", "masters_left_to_a_failed_step")
"""What :func:`take_back_misses` can leave out of a take-back."""


@contextlib.contextmanager
def updates_held_back_to_step() -> Iterator[None]:
    """Inside the backward no batch is ever ready (``SwapConfig(step="in_backward")``): every update waits for
    ``step()``."""
    with mock.patch.object(in_backward_driver, "_ready", lambda final, params: False):
        yield


@contextlib.contextmanager
def provisional_copy_outs_not_held() -> Iterator[None]:
    """A provisional walk copies its last batch out right after its update, as any walk does, instead of holding the
    copy-out until ``step()`` commits: a step taken back then waits for a copy nobody reads before it runs again."""
    with mock.patch.object(BatchWalk, "_holds_copy_out", lambda self, *, last: False):
        yield


@contextlib.contextmanager
def copy_ins_wait_for_the_copy_out(batches_before: int) -> Iterator[None]:
    """Each packed copy-in waits, half by half, for the copy-out of the batch ``batches_before`` before it in the
    walk, whatever arena it takes, and is issued only once that copy-out is (with three staging buffers and
    ``batches_before=2``: the extra wait two arenas need, so that the third buffers nothing)."""
    walk = ArenaStaging.walk

    def held_back(self: ArenaStaging, *args: Any, **kwargs: Any) -> StagingWalk:
        staging_walk = walk(self, *args, **kwargs)
        offloads: dict[int, Offloaded] = {}
        copied_out = staging_walk.copied_out

        def record(position: int, offloaded: Offloaded) -> None:
            offloads[position] = offloaded
            copied_out(position, offloaded)

        needs_memory_of = staging_walk.needs_memory_of
        staging_walk.copied_out = record  # type: ignore[method-assign]
        staging_walk.before_copy_in = lambda position: offloads.get(position - batches_before)  # type: ignore[method-assign]
        # The copy-in is issued once that copy-out is, as if it took that batch's arena.
        staging_walk.needs_memory_of = (  # type: ignore[method-assign]
            lambda position, earlier: earlier == position - batches_before or needs_memory_of(position, earlier)
        )
        return staging_walk

    with mock.patch.object(ArenaStaging, "walk", held_back):
        yield


@contextlib.contextmanager
def copy_ins_issued_after_the_copy_out_before() -> Iterator[None]:
    """Each packed copy-in is issued only once the batch before it was copied out (as if it took that batch's
    memory), so the link never runs both ways at once."""
    walk = ArenaStaging.walk

    def held_back(self: ArenaStaging, *args: Any, **kwargs: Any) -> StagingWalk:
        staging_walk = walk(self, *args, **kwargs)
        staging_walk.needs_memory_of = lambda position, earlier: True  # type: ignore[method-assign]
        return staging_walk

    with mock.patch.object(ArenaStaging, "walk", held_back):
        yield


@contextlib.contextmanager
def prefetch_of_one_batch() -> Iterator[None]:
    """``prefetch()`` copies in one batch, as with two staging buffers, whatever their number (packed): no batch
    takes the memory of a batch two or more before it (the walk copies one batch ahead anyway)."""
    walk = ArenaStaging.walk

    def one_ahead(self: ArenaStaging, *args: Any, **kwargs: Any) -> StagingWalk:
        staging_walk = walk(self, *args, **kwargs)
        needs_memory_of = staging_walk.needs_memory_of
        staging_walk.needs_memory_of = (  # type: ignore[method-assign]
            lambda position, earlier: position - earlier >= 2 or needs_memory_of(position, earlier)
        )
        return staging_walk

    with mock.patch.object(ArenaStaging, "walk", one_ahead):
        yield


@contextlib.contextmanager
def plans_built() -> Iterator[list[int]]:
    """Not a bug: counts the plans built in the block (the list grows by one per plan, with its batch count), for a
    test that a plan is kept while nothing it depends on changes."""
    built: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        plan = build_plan(*args, **kwargs)
        built.append(len(plan.batches))
        return plan

    with mock.patch.object(plan_cache, "build_plan", counted):
        yield built


@contextlib.contextmanager
def commits_without_the_check() -> Iterator[None]:
    """``step()`` commits the step begun inside the backward whatever changed since (clipped gradients, a new
    learning rate...)."""
    with mock.patch.object(in_backward_driver, "why_not_commit", lambda *args, **kwargs: []):
        yield


@contextlib.contextmanager
def packed_host_in_one_buffer_per_dtype() -> Iterator[None]:
    """Packed host memory ignores the backend's ``max_host_buffer_bytes``: one buffer per dtype, whatever its size
    (a driver that refuses such a registration falls back to the caching allocator, or to pageable memory)."""
    layout = packed._layout
    with mock.patch.object(packed, "_layout", lambda slots, max_buffer_bytes: layout(slots, 1 << 62)):
        yield


@contextlib.contextmanager
def commit_check_fails() -> Iterator[None]:
    """The check of ``step()`` that decides whether the step begun inside the backward commits raises (as a read of
    the device that fails would)."""

    def fails(*args: Any, **kwargs: Any) -> list[str]:
        raise RuntimeError("planted: the commit check fails")

    with mock.patch.object(in_backward_driver, "why_not_commit", fails):
        yield


@contextlib.contextmanager
def take_back_misses(part: str) -> Iterator[None]:
    """A take-back of provisional updates leaves ``part`` (one of :data:`TAKE_BACK_PARTS`) as the updates wrote it:
    the swapped states (their copy-outs write the mirrors, as a final step's do), the resident states or the
    parameters (not kept before the update), the parameters of the masters (not rounded again from the masters
    as they were), or those a take-back left to the step that runs again, when that step fails (not rounded again
    from the masters as the failure left them)."""
    kept_nothing: dict[str, str] = {
        "resident_states": "keep_states",
        "params": "keep_params",
        "masters": "keep_from_master",
    }
    patch: contextlib.AbstractContextManager[Any]
    if part == "swapped_states":
        offload = PipelineScheduler.offload_batch

        def to_the_mirrors(self: PipelineScheduler, *args: Any, **kwargs: Any) -> Offloaded:
            return offload(self, *args, **{**kwargs, "to_spare": False})

        patch = mock.patch.object(PipelineScheduler, "offload_batch", to_the_mirrors)
    elif part == "masters_left_to_a_failed_step":
        patch = mock.patch.object(UpdateUndo, "restore_left", _forgets_left)
    elif part in kept_nothing:
        patch = mock.patch.object(UpdateUndo, kept_nothing[part], _keeps_nothing)
    else:
        raise ValueError(f"take_back_misses({part!r}): expected one of {TAKE_BACK_PARTS}")
    with patch:
        yield


def _keeps_nothing(*args: Any, **kwargs: Any) -> None:
    """An :class:`UpdateUndo` keep that keeps nothing (``keep_params``' event: none)."""


def _forgets_left(self: UpdateUndo, *, compute: object) -> None:
    """:meth:`UpdateUndo.restore_left` that rounds nothing again."""
    self.forget_left()
