"""A step begun inside the backward, and what ``step()`` decides of it: commit, or take it back and step again.

With provisional updates the step commits only when nothing its updates read changed since they ran (:func:`why_not
_commit` lists what did): the gradients a batch used (written in place or replaced: ``clip_grad_norm_`` multiplies
every gradient, ``GradScaler.unscale_`` too), the hyperparameters it began with, the state and the param groups (an
edit, a load), and ``GradScaler``'s scale handed
to ``step()`` (the updates used scaled gradients). Otherwise it is taken back and the step runs after the backward,
as the plain optimizer's would, with ``GradScaler``'s skip (a gradient with inf or NaN) or unscale first
(:class:`AmpScaling`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...errors import SwapStateError
from ...runtime.batch_walk import BatchWalk
from ...runtime.pipeline import PipelineScheduler
from ...runtime.plan import SwapPlan
from ...runtime.step_journal import note_on
from ...runtime.update_undo import UpdateUndo
from ...stats import SwapStats
from ...torch_compat import unscale_gradients_
from ...trace import StepTrace
from ..state_sync import StateSync
from ..step_driver import StepOutcome
from .gradient_watch import GradientWatch
from .group_snapshot import GroupSnapshot
from .run import InBackwardRun

__all__ = [
    "AmpScaling",
    "Started",
    "TakeBack",
    "commit",
    "end_as_begun",
    "refuse_edits_since_the_backward",
    "stepped_again",
    "why_not_commit",
]


class TakeBack:
    """Takes back the provisional step that is open, if one is: its walk dropped (the host mirrors never changed),
    the parameters and resident states it wrote put back, the values it wrote to the param groups too.

    It holds the scheduler, what the batches kept and the open step's plan and group snapshots, never the optimizer:
    the finalizer that runs it when the optimizer is collected must not keep the optimizer alive."""

    def __init__(self, scheduler: PipelineScheduler, undo: UpdateUndo) -> None:
        self._scheduler, self._undo = scheduler, undo
        self._open: tuple[SwapPlan, GroupSnapshot, list[dict[str, Any]]] | None = None
        self.groups_after: GroupSnapshot | None = None
        """The param groups right after the last batch updated."""

    def opened(self, plan: SwapPlan, groups: GroupSnapshot, param_groups: list[dict[str, Any]]) -> None:
        """A provisional step began over ``plan``, the param groups (``param_groups``) as ``groups`` took them."""
        self._open, self.groups_after = (plan, groups, param_groups), None

    def stepped_again(self, *, failed: bool) -> None:
        """The step that followed a take-back ran, or ``failed``: the parameters left to it are its, or are rounded
        again from their masters as the failure left them."""
        if failed:
            self._undo.restore_left(compute=self._scheduler.compute)
        else:
            self._undo.forget_left()

    def closed(self) -> None:
        """The open step committed (or was taken back)."""
        self._open, self.groups_after = None, None
        self._undo.clear()

    def __call__(self, *, left_to_a_step: Callable[[torch.Tensor], bool] | None = None) -> bool:
        """Take the open step back; whether one was open. ``left_to_a_step``: the step runs again right after, and
        rounds again from their masters the parameters for which this is true (:meth:`UpdateUndo.restore`)."""
        opened, self._open = self._open, None
        if opened is None:
            return False
        plan, groups, param_groups = opened
        self._scheduler.abandon_plan(plan, provisional=True)
        self._undo.restore(compute=self._scheduler.compute, left_to_a_step=left_to_a_step)
        groups.undo_since(param_groups, self.groups_after or groups)
        self.groups_after = None
        return True


@dataclasses.dataclass
class Started:
    """A step begun inside the backward: its run, its walk, the adapter's step scope and what it began with."""

    run: InBackwardRun
    walk: BatchWalk
    stats: SwapStats
    scope: contextlib.ExitStack
    groups: GroupSnapshot
    """The hyperparameters the batches updated with."""
    trace: StepTrace | None
    """With ``SwapConfig(trace=True)``: the step's timeline, timed from its first hook."""

    def close(self) -> None:
        self.scope.close()
        self.run.release()

    def outcome(self) -> StepOutcome:
        """The step's outcome once its walk ended."""
        return StepOutcome(self.stats, self.trace, self.walk.plan)


def commit(started: Started, scheduler: PipelineScheduler, sync: StateSync, take_back: TakeBack) -> None:
    """Nothing the provisional updates of ``started`` read changed: the batches left update now (and the last batch's
    held copy-out is issued), and the step commits (the spare host copies become the mirrors, copying nothing); keys
    its updates added to existing states then go to host memory. Should that fail, the step is taken back before the
    error propagates: nothing changed, and ``step()`` may run again."""
    try:
        try:
            scheduler.end(started.walk, trace=started.trace)
        except BaseException as error:
            take_back()
            note_on(
                error,
                "swap: the step begun inside the backward was taken back (parameters and states as before that "
                "backward); the gradients are kept, so step() may be called again",
            )
            raise
        started.run.finish()
    finally:
        started.close()
    sync.store.flip()
    started.walk.plan.flip_host_copies()
    sync.mirrors_moved()
    take_back.closed()
    started.run.move_grown_states()


def end_as_begun(
    started: Started, scheduler: PipelineScheduler, param_groups: list[dict[str, Any]]
) -> tuple[list[str], list[torch.Tensor]]:
    """Without provisional updates: the rest of the step with the values it began with (keys its updates added to
    existing states then go to host memory); what changed since, for the refusal after it (the param groups' values,
    the gradients edited)."""
    changed = started.groups.changes(param_groups)
    try:
        with started.groups.in_place(param_groups):
            scheduler.end(started.walk, trace=started.trace)
        edited = started.run.edited_gradients()
        started.run.finish()
    finally:
        started.close()
    started.run.move_grown_states()
    return changed, edited


def stepped_again(sync: StateSync) -> Callable[[torch.Tensor], bool]:
    """Whether the step after the backward updates a parameter: it is in the param groups as they are now and has a
    gradient."""
    stepped = {id(param) for param in sync.ordered_params() if param.grad is not None}
    return lambda param: id(param) in stepped


@dataclasses.dataclass(frozen=True)
class AmpScaling:
    """What ``GradScaler.step`` handed ``step()`` (it claims the scaling): the scale the gradients carry (``None``:
    ``unscale_`` ran already) and whether one holds an inf or a NaN."""

    grad_scale: torch.Tensor | None
    found_inf: torch.Tensor | None

    def skips(self) -> bool:
        """Whether ``GradScaler`` would skip this step (a gradient holds an inf or a NaN); the host reads it, as
        ``GradScaler``'s own check does."""
        return self.found_inf is not None and bool(self.found_inf.item())

    def unscale(self, params: Sequence[torch.Tensor]) -> None:
        """The gradients of ``params`` unscaled in place, as ``GradScaler.unscale_`` does (one call of its kernel per
        device and dtype, the inverse scale computed as it computes it); nothing when they were unscaled already."""
        if self.grad_scale is None:
            return
        inv_scale = self.grad_scale.double().reciprocal().float()
        by_device_and_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for param in params:
            if param.grad is not None:
                by_device_and_dtype.setdefault((param.grad.device, param.grad.dtype), []).append(param.grad)
        for (device, _), grads in by_device_and_dtype.items():
            found_inf = torch.zeros((1,), dtype=torch.float32, device=device)
            unscale_gradients_(grads, found_inf, inv_scale.to(device))


def why_not_commit(started: Started, sync: StateSync, amp: AmpScaling | None) -> list[str]:
    """What changed since the provisional updates of ``started`` read it, one line each (empty: it commits). The
    gradients are compared last, only when nothing else changed: that reads their fingerprints' comparison on the
    host, which waits for the current stream."""
    reasons = []
    if amp is not None:
        reasons.append("GradScaler handed the step its scale: the updates inside the backward used scaled gradients")
    reasons += started.groups.changes(sync.param_groups)
    if sync.has_edits():
        reasons.append("the state or the param groups were edited between backward() and step()")
    if reasons:
        return reasons
    edited = started.run.edited_gradients()
    if edited:
        reasons.append(
            f"{len(edited)} gradient(s) changed after their batch used them (the first of shape "
            f"{tuple(edited[0].shape)})"
        )
    return reasons


def refuse_edits_since_the_backward(
    seen: GradientWatch, repeated: bool, *, provisional: bool, read_to_host: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """``step()`` after backwards in which no step began: refuse, before anything changes, gradients accumulated over
    several backwards outside ``opt.accumulating()`` (a later step would begin inside the first of them), and,
    without provisional updates, gradients edited after their hooks ran (a later step would have updated with
    them unedited)."""
    if repeated:
        raise SwapStateError(
            "Gradients were accumulated over several backwards before step() outside opt.accumulating(): "
            "with SwapConfig(step='in_backward') the first backward would update the batches, before the "
            "others added to their gradients. Refused now, before anything changed: run the backwards of "
            "the micro-batches before the last one inside `with opt.accumulating():`, or use "
            "step='after_backward'"
        )
    if provisional:
        return
    edited = seen.changed(read_to_host)
    if edited:
        raise SwapStateError(
            f"{len(edited)} gradient(s) changed between the backward and step() (e.g. the first of shape "
            f"{tuple(edited[0].shape)}): DDP's all-reduce, clip_grad_norm_, GradScaler or any edit of the "
            "gradients after their post-accumulate-grad hooks ran. With SwapConfig(step='in_backward', "
            "provisional_updates=False) the batches update from those hooks, before such an edit, so it is refused "
            "now, before anything changed. Keep provisional_updates=True, or edit gradients with "
            "step='after_backward'"
        )
