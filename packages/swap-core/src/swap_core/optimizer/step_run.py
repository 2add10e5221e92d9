"""One ``step()``'s work on the batches: its gradients, its journal, and the update of each batch."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from ..adapters.base import UpdateBatch
from ..backends.protocol import Stream
from ..errors import SwapStateError
from ..runtime.dtensor import local_tensor
from ..runtime.plan import PlannedBatch, SwapPlan
from ..runtime.slots import SwapSlot
from ..runtime.state_keys import is_fresh
from ..runtime.step_journal import StepJournal, note_partial_step
from ..stats import SwapStats
from ..trace import StepTrace
from .gradient_watch import GradientWatch
from .plan_cache import PlanCache
from .state_sync import NO_ENTRY, StateSync

__all__ = ["StepRun"]

_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")


class StepRun:
    """Made per ``step()`` (per attempt, with ``swap_times="auto"``'s retry): reads the gradients, makes missing
    states, plans, runs the pipeline with :meth:`update` for each batch, and undoes what it can when it fails."""

    def __init__(self, sync: StateSync, plans: PlanCache, update: Callable[[UpdateBatch], None]) -> None:
        """``update``: the adapter's update of one batch segment (on the fp32 masters, with master weights)."""
        self.sync = sync
        self.plans = plans
        self.adapter = sync.adapter
        self._update_batch = update
        self.creation = plans.creation
        self.grads: list[torch.Tensor | None] = []
        """Every parameter's gradient, in parameter order, for the batches to slice."""
        self.batches_updated = 0
        self._every_param_ready = False
        self._journal: StepJournal | None = None
        self._ordered: list[torch.Tensor] = []
        self._applied = GradientWatch()
        """Inside the backward: each parameter a batch updated, with the gradient it used."""
        self._positions: dict[int, int] = {}
        self._created: list[torch.Tensor] = []
        """The parameters this step made states for before its batches (removed again if it fails before any)."""

    def release(self) -> None:
        """Drop the step's references to gradients and saved values (``zero_grad(set_to_none=True)`` frees them)."""
        self.grads = []
        self._journal = None
        self._applied, self._positions = GradientWatch(), {}

    def run(self, stats: SwapStats, trace: StepTrace | None) -> SwapPlan:
        """The step's work (inside the scheduler's ``working()``): follow the user's edits, read the gradients, make
        missing states, plan, run the pipeline; the plan it ran."""
        sync, adapter = self.sync, self.adapter
        ordered = sync.ordered_params()
        sync.follow_edits(ordered)
        with_grad = self._collect_grads(ordered)
        creation = self.creation
        creation.before_journal(ordered)
        self._journal = self._step_journal()
        plan: SwapPlan | None = None
        try:
            self._created = creation.make_missing(self.plans.states_complete(), self.params_with_grad)
            plan = self.plans.current()
            entries_before = creation.before_batches(plan, self.params_with_grad)
            # Every parameter has a gradient and a state (the usual step): batches skip per-parameter checks.
            self._every_param_ready = plan.all_states_exist and with_grad == plan.param_count
            skip = self._batches_without_gradients(plan, with_grad)
            with adapter.step_scope():
                if plan.batches:  # an optimizer without parameters steps nothing, as torch's does
                    sync.scheduler.run(
                        plan, self.update, stats, keep_staging=sync.config.keep_staging, trace=trace, skip=skip
                    )
        except BaseException as error:
            self._after_failure(error, 0 if plan is None else len(plan.batches) + (plan.resident is not None))
            raise
        creation.after_run(ordered, entries_before)
        return plan

    # -- gradients ----------------------------------------------------------------------
    def _collect_grads(self, ordered: list[torch.Tensor]) -> int:
        """Read every parameter's gradient once, check it is dense and declare it to the backend.

        Runs over every parameter in every step, so it stays lean (C-level scans). Returns how many
        parameters have a gradient.
        """
        grads: list[torch.Tensor | None] = list(map(_GRAD, ordered))
        self.grads = grads
        present = [grad for grad in grads if grad is not None]
        if any(map(_IS_SPARSE, present)):
            index = next(i for i, grad in enumerate(grads) if grad is not None and grad.is_sparse)
            raise _sparse_gradient(*self.sync.ordered_params_with_groups()[index])
        adopt = self.sync.backend.adopt
        for grad in present:
            adopt(_local_grad(grad))
        return len(present)

    def params_with_grad(self) -> list[tuple[int, torch.Tensor]]:
        """``(group index, parameter)`` of the parameters that have a gradient this step."""
        ordered = self.sync.ordered_params_with_groups()
        return [entry for entry, grad in zip(ordered, self.grads, strict=True) if grad is not None]

    def _batches_without_gradients(self, plan: SwapPlan, with_grad: int) -> frozenset[int]:
        """Batches no parameter of which has a gradient this step: nothing to update, so nothing to copy (torch's
        step skips such parameters too). None when every parameter has one, or when every batch must run."""
        if with_grad == plan.param_count or plan.walk_every_batch:
            return frozenset()
        grads = self.grads
        return frozenset(
            batch.index
            for batch in plan.batches
            if all(
                grad is None
                for _, _, _, where in batch.segments
                for grad in (grads[where] if isinstance(where, slice) else [grads[i] for i in where])
            )
        )

    # -- one batch ------------------------------------------------------------------------
    def update(self, batch: PlannedBatch) -> None:
        """Update ``batch`` on the device: its states' device copies stand in ``state`` meanwhile."""
        sync = self.sync
        fresh: list[torch.Tensor] = []
        with _device_states_in_place(batch):
            for group_index, segment_params, segment_states, where in batch.segments:
                grads_in_order = self.grads
                segment_grads = (
                    grads_in_order[where] if isinstance(where, slice) else [grads_in_order[i] for i in where]
                )
                if self._every_param_ready:
                    params, states = segment_params, cast("list[dict[str, Any]]", segment_states)
                    grads = cast("list[torch.Tensor]", segment_grads)
                else:
                    missing = self.creation.missing_state
                    params, grads, states = _with_grad(segment_params, segment_grads, segment_states, missing)
                    fresh += self.creation.fresh(params, states)
                if params:
                    group = sync.param_groups[group_index]
                    if self._journal is not None:
                        self._journal.record(params, states)
                    self._update_batch(UpdateBatch(group, params, grads, states, batch.index))
        self.batches_updated += 1
        if fresh:
            # States the update just created on the device go to host memory now, before the next batch
            # creates its own (one batch of fresh states on the device at a time).
            sync.offload_existing_states(fresh, unpacked=True)
            sync.changed()  # the batches are bound to the entries of state that existed before

    # -- a step inside the backward -------------------------------------------------------
    def begin_in_backward(self) -> None:
        """The start of a step whose batches update inside the backward (``SwapConfig(step="in_backward")``): no
        gradient is read yet, each batch reads its own once they are final (:meth:`update_in_backward`)."""
        self._ordered = self.sync.ordered_params()
        self.grads = [None] * len(self._ordered)

    def update_in_backward(self, batch: PlannedBatch) -> None:
        """:meth:`update` of a batch whose gradients are final: they are read now, and noted so that the end of the
        step can tell whether one was edited after it was applied (:meth:`edited_gradients`)."""
        ordered, grads = self._ordered, self.grads
        adopt = self.sync.backend.adopt
        for group_index, _, _, where in batch.segments:
            for position in range(len(grads))[where] if isinstance(where, slice) else where:
                param = ordered[position]
                grad = grads[position] = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise _sparse_gradient(group_index, param)
                adopt(_local_grad(grad))
                self._applied.note(param, grad)
                self._positions[id(param)] = position
        self.update(batch)

    def applied(self, param: torch.Tensor) -> bool:
        """Whether a batch of this step updated ``param`` with its gradient already."""
        return param in self._applied

    def free_gradients(self, batch: PlannedBatch, *, allocated_on: Stream) -> None:
        """Drop the gradients ``batch`` updated with, the parameters' (``p.grad = None``) and this step's references
        (its issued update holds them until it ran); :meth:`edited_gradients` then expects ``None`` there.
        ``allocated_on``: the stream torch made them under (the hooks'): their blocks are kept from its pool until
        the update, issued to the steps' stream, is done (``DeviceBackend.free_when_done``)."""
        backend, steps = self.sync.backend, self.sync.scheduler.compute
        for _, param in batch.params:
            if self._applied.drop(param):
                position = self._positions[id(param)]
                grad = self.grads[position]
                if grad is not None and allocated_on != steps:
                    backend.free_when_done(_local_grad(grad), allocated_on=allocated_on, in_use_on=steps)
                self.grads[position] = None

    def edited_gradients(self) -> list[torch.Tensor]:
        """The parameters whose gradient was replaced or written in place since its batch updated with it (or set
        again after :meth:`free_gradients` dropped it)."""
        return self._applied.changed()

    # -- a failed step ------------------------------------------------------------------
    def _step_journal(self) -> StepJournal | None:
        """The journal of this step, or ``None``: kept for a step that creates every state it updates (then undoing
        it costs a copy of its parameters only), and for every step with ``SwapConfig(undo_failed_steps=True)``
        (see :mod:`~swap_core.runtime.step_journal`)."""
        undo_every_step = self.sync.config.undo_failed_steps
        if not undo_every_step and self.plans.states_complete():
            return None  # the usual step: no per-parameter scan
        params = [param for _, param in self.params_with_grad()]
        created = [param for param in params if is_fresh(self.sync.state.get(param) or {})]
        if not params or (not undo_every_step and len(created) < len(params)):
            return None
        return StepJournal(self.sync.backend, created, keeps_states=undo_every_step)

    def _after_failure(self, error: BaseException, batches: int) -> None:
        """The step raised: undo it whole where its journal allows, else say what it applied."""
        journal, sync = self._journal, self.sync
        if journal is None:
            if not self.batches_updated:
                self._forget_created_states()
            note_partial_step(error, self.batches_updated, batches)
            return
        sync.scheduler.synchronize()  # every copy of this step has landed: the mirrors may be written
        journal.restore_params()
        state, store = sync.state, sync.store
        for param, saved in journal.saved_states:
            entry = state[param]
            slots = store.slots.get(param, NO_ENTRY)
            for key in [key for key in entry if key not in saved]:  # keys the failed update added
                del entry[key]
            for key, value in saved.items():
                if not isinstance(value, torch.Tensor):
                    entry[key] = value
                elif key in slots:  # swapped: back into its host mirror
                    entry[key] = slots[key].host_value
                    with sync.backend.host_scope():
                        local_tensor(slots[key].host_value).copy_(value)
                else:
                    local_tensor(entry[key]).copy_(value)
        for param in journal.created:  # the states this step made go, as if it never ran
            if param in state:
                del state[param]
        sync.changed()

    def _forget_created_states(self) -> None:
        """A step that failed before any batch updated leaves no state it made (``add_param_group`` then a plan that
        does not fit: the new parameters have no state, as torch's never-stepped ones)."""
        state = self.sync.state
        for param in self._created:
            state.pop(param, None)
        if self._created:
            self.sync.changed()


def _sparse_gradient(group_index: int, param: torch.Tensor) -> RuntimeError:
    return RuntimeError(
        f"Parameter {tuple(param.shape)} of param group {group_index} has a sparse gradient; "
        "swapping supports dense gradients only"
    )


def _local_grad(grad: torch.Tensor) -> torch.Tensor:
    """The gradient's local tensor (a DTensor's shard), as the backend declares it."""
    return grad if type(grad) is torch.Tensor else local_tensor(grad)


@contextlib.contextmanager
def _device_states_in_place(batch: PlannedBatch) -> Iterator[None]:
    """During its update a batch's ``state`` entries are the device copies; host mirrors again after.

    Swapping entries in place (rather than handing the adapter merged copies)
    keeps whatever the update writes to resident entries, at two dict stores per state.
    """
    for state, slot, view in zip(batch.slot_states, batch.slots, batch.update_views, strict=True):
        state[slot.key] = view
    try:
        yield
    except BaseException:
        for state, slot in zip(batch.slot_states, batch.slots, strict=True):
            state[slot.key] = slot.host_value
        raise
    for state, slot, view in zip(batch.slot_states, batch.slots, batch.update_views, strict=True):
        value = state.get(slot.key)
        if value is not view:  # the update assigned a new tensor instead of writing the state in place
            _take_replaced_state(slot, view, value)
        state[slot.key] = slot.host_value


def _with_grad(
    params: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    states: list[dict[str, Any] | None],
    missing_state: Callable[[torch.Tensor], dict[str, Any]],
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[dict[str, Any]]]:
    """The parameters of a batch segment that have a gradient this step, with their gradients and states
    (``missing_state(param)`` for one that had no entry when the plan was made)."""
    kept_params, kept_grads, kept_states = [], [], []
    for param, grad, state in zip(params, grads, states, strict=True):
        if grad is None:
            continue
        if state is None:
            state = missing_state(param)
        kept_params.append(param)
        kept_grads.append(grad)
        kept_states.append(state)
    return kept_params, kept_grads, kept_states


def _take_replaced_state(slot: SwapSlot, view: torch.Tensor, value: object) -> None:
    """The update put a new tensor where a swapped state's device copy was: the copy takes its values."""
    local = local_tensor(value) if isinstance(value, torch.Tensor) else None
    device_copy = local_tensor(view)
    if local is None or local.shape != device_copy.shape or local.dtype != device_copy.dtype:
        found = f"a {tuple(local.shape)} {local.dtype} tensor" if local is not None else repr(value)
        raise SwapStateError(
            f"The update replaced swapped state {slot.key!r} ({tuple(device_copy.shape)} {device_copy.dtype}) by "
            f"{found}: a swapped state must keep its shape and dtype. Keep this key on the device "
            "(SwapConfig(state_keys=...) without it)"
        )
    device_copy.copy_(local)
