"""One ``step()``'s work on the batches: its gradients, its states made, its plan, its journal, and the update of
each batch; undone where it can be when the step fails."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch

from ..adapters.base import UpdateBatch
from ..dtensor import local_tensor
from ..errors import SwapStateError
from ..runtime.nested_entries import SEPARATOR, located
from ..runtime.plan import PlannedBatch, SwapPlan
from ..runtime.slots import SwapSlot
from ..runtime.state_keys import is_fresh
from ..runtime.step_journal import SavedNest, StepJournal, note_partial_step
from .plan_cache import PlanCache
from .setup import SwapSetup
from .state_creation import StateCreation
from .state_sync import NO_ENTRY, StateSync

__all__ = ["StepRun", "local_grad", "sparse_gradient"]

_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")


class StepRun:
    """Made per attempt at a step: :meth:`prepare` reads the gradients, makes missing states and plans; the step
    driver walks the plan with :meth:`update` for each batch; :meth:`finish` puts the made states in order, and
    :meth:`failed` undoes what it can when the step raised."""

    journals_every_step = True
    """With ``SwapConfig(undo_failed_steps=True)``, whether this run keeps the journal that undoes it (a provisional
    step begun inside the backward is taken back whole without one)."""

    def __init__(self, setup: SwapSetup, sync: StateSync, plans: PlanCache) -> None:
        self.setup = setup
        self.sync = sync
        self.plans = plans
        self.grads: list[torch.Tensor | None] = []
        """Every parameter's gradient, in parameter order, for the batches to slice."""
        self.updates_begun = 0
        """Batches whose update began (a step with none may run again: nothing changed)."""
        self.batches_updated = 0
        """Batches whose update ran to its end."""
        self._every_param_ready = False
        self._journal: StepJournal | None = None
        self._plan: SwapPlan | None = None
        self._ordered: list[torch.Tensor] = []
        self._created: list[torch.Tensor] = []
        """The parameters this step made states for before its batches (removed again if it fails before any)."""
        self._entries_before: set[int] | None = None

    def release(self) -> None:
        """Drop the step's references to gradients and saved values (``zero_grad(set_to_none=True)`` frees them)."""
        self.grads = []
        self._journal = None

    def prepare(self) -> SwapPlan:
        """Follow the user's edits, read the gradients, make missing states and plan (inside the scheduler's
        ``working()``); the plan to walk. A failure here is a failed step (:meth:`failed`)."""
        sync, creation = self.sync, self.setup.creation
        self._ordered = ordered = sync.ordered_params()
        sync.follow_edits(ordered)
        with_grad = self._read_gradients(ordered)
        creation.before_journal(sync, ordered)
        self._journal = self._step_journal()
        self._created = creation.make_missing(sync, self.plans.states_complete(), self.params_with_grad)
        self._plan = plan = self.plans.current()
        self._entries_before = creation.before_batches(
            sync, plan, self.params_with_grad, reverse=self.setup.plan_shape.reverse
        )
        # Every parameter has a gradient and a state (the usual step): batches skip per-parameter checks.
        self._every_param_ready = plan.all_states_exist and with_grad == plan.param_count
        return plan

    def finish(self) -> None:
        """After the walk: the states the batches made put in order and packed."""
        self.setup.creation.after_run(self.sync, self._ordered, self._entries_before)

    # -- gradients ----------------------------------------------------------------------
    def _read_gradients(self, ordered: list[torch.Tensor]) -> int:
        """Read every parameter's gradient once, check it is dense and declare it to the backend.

        Runs over every parameter in every step, so it stays lean (C-level scans). Returns how many
        parameters have a gradient.
        """
        grads: list[torch.Tensor | None] = list(map(_GRAD, ordered))
        self.grads = grads
        present = [grad for grad in grads if grad is not None]
        if any(map(_IS_SPARSE, present)):
            index = next(i for i, grad in enumerate(grads) if grad is not None and grad.is_sparse)
            raise sparse_gradient(*self.sync.ordered_params_with_groups()[index])
        adopt = self.setup.backend.adopt
        for grad in present:
            adopt(local_grad(grad))
        return len(present)

    def params_with_grad(self) -> list[tuple[int, torch.Tensor]]:
        """``(group index, parameter)`` of the parameters that have a gradient this step."""
        ordered = self.sync.ordered_params_with_groups()
        return [entry for entry, grad in zip(ordered, self.grads, strict=True) if grad is not None]

    def skipped(self, plan: SwapPlan) -> frozenset[int]:
        """Batches no parameter of which has a gradient this step: nothing to update, so nothing to copy (torch's
        step skips such parameters too). None when every parameter has one, or when every batch must run."""
        grads = self.grads
        if plan.walk_every_batch or all(grad is not None for grad in grads):
            return frozenset()
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
        sync, creation = self.sync, self.setup.creation
        fresh: list[torch.Tensor] = []
        grown: list[torch.Tensor] = []
        self.updates_begun += 1
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
                    params, grads, states = _with_grad(segment_params, segment_grads, segment_states, sync, creation)
                    fresh += creation.fresh(params, states)
                if params:
                    group = sync.param_groups[group_index]
                    if self._journal is not None:
                        self._journal.record(params, states)
                    beside = self.setup.adapter.entries_written_beside(group, params)
                    if beside:
                        self._keep_beside(beside)
                    # An update that makes its states may add a key to one it made before (an SWA average).
                    counts = list(map(len, states)) if creation.update_adds_keys else None
                    self.setup.update.update(UpdateBatch(group, params, grads, states, batch.index))
                    if counts is not None and counts != list(map(len, states)):
                        pairs = zip(params, states, counts, strict=True)
                        grown += [param for param, state, count in pairs if len(state) > count]
        if fresh or grown:
            self._move_made_states(fresh, grown)
        self.batches_updated += 1

    def _move_made_states(self, fresh: list[torch.Tensor], grown: list[torch.Tensor]) -> None:
        """States the update just created on the device (``fresh``), and keys it added to existing states
        (``grown``), go to host memory now, before the next batch creates its own (one batch of them on the device
        at a time)."""
        made = {id(param) for param in fresh}
        self.sync.offload_existing_states([*fresh, *(param for param in grown if id(param) not in made)], unpacked=True)
        self.sync.changed()  # the batches are bound to the entries of state that existed before

    def _keep_beside(self, params: Sequence[torch.Tensor]) -> None:
        """The entries of ``params`` (outside the batch) that the batch's update writes too, kept by the journal."""
        if self._journal is not None:
            self._journal.beside.keep(self.entries_with_swapped_keys(params))

    def entries_with_swapped_keys(self, params: Sequence[torch.Tensor]) -> list[tuple[dict[str, Any], frozenset[str]]]:
        """``(entry of state, its swapped keys)`` of each of ``params``."""
        state, slots = self.sync.state, self.sync.store.slots
        return [(state[param], frozenset(slots.get(param, NO_ENTRY))) for param in params]

    # -- a failed step ------------------------------------------------------------------
    def _step_journal(self) -> StepJournal | None:
        """The journal of this step, or ``None``: kept for a step that creates every state it updates (then undoing
        it costs a copy of its parameters only), and for every step with ``SwapConfig(undo_failed_steps=True)``
        (see :mod:`~swap_core.runtime.step_journal`)."""
        undo_every_step = self.setup.undo_failed_steps and self.journals_every_step
        if not undo_every_step and self.plans.states_complete():
            return None  # the usual step: no per-parameter scan
        params = [param for _, param in self.params_with_grad()]
        created = [param for param in params if is_fresh(self.sync.state.get(param) or {})]
        if not params or (not undo_every_step and len(created) < len(params)):
            return None
        return StepJournal(self.setup.backend, created, keeps_states=undo_every_step)

    def failed(self, error: BaseException) -> None:
        """The step raised ``error``: undo it whole where its journal allows, else say what it applied."""
        journal, sync, plan = self._journal, self.sync, self._plan
        if journal is None:
            if not self.updates_begun:
                self._forget_created_states()
            batches = 0 if plan is None else len(plan.batches) + (plan.resident is not None)
            note_partial_step(error, self.batches_updated, batches)
            return
        self.setup.scheduler.synchronize()  # every copy of this step has landed: the mirrors may be written
        journal.restore_params()
        state, store = sync.state, sync.store
        for param, saved in journal.saved_states:
            self._put_back_entry(state[param], saved, store.slots.get(param, NO_ENTRY))
        journal.beside.put_back()
        for param in journal.created:  # the states this step made go, as if it never ran
            if param in state:
                del state[param]
        sync.changed()

    def _put_back_entry(self, entry: dict[str, Any], saved: dict[str, Any], slots: Any, prefix: str = "") -> None:
        """``entry`` as the journal ``saved`` it (a dict nested in it too, its keys' paths under ``prefix``): keys the
        failed update added removed, swapped values back into their host mirrors, resident ones copied back."""
        for key in [key for key in entry if key not in saved]:  # keys the failed update added
            del entry[key]
        for key, value in saved.items():
            path = prefix + key
            if isinstance(value, SavedNest):
                nest = entry.get(key)
                entry[key] = nest = nest if isinstance(nest, dict) else {}
                self._put_back_entry(nest, value, slots, prefix=f"{path}{SEPARATOR}")
            elif not isinstance(value, torch.Tensor):
                entry[key] = value
            elif path in slots:  # swapped: back into its host mirror
                entry[key] = slots[path].host_value
                with self.setup.backend.host_scope():
                    local_tensor(slots[path].host_value).copy_(value)
            else:
                local_tensor(entry[key]).copy_(value)

    def _forget_created_states(self) -> None:
        """A step that failed before any batch updated leaves no state it made (``add_param_group`` then a plan that
        does not fit: the new parameters have no state, as torch's never-stepped ones)."""
        state = self.sync.state
        for param in self._created:
            state.pop(param, None)
        if self._created:
            self.sync.changed()


def sparse_gradient(group_index: int, param: torch.Tensor) -> RuntimeError:
    return RuntimeError(
        f"Parameter {tuple(param.shape)} of param group {group_index} has a sparse gradient; "
        "swapping supports dense gradients only"
    )


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """The gradient's local tensor (a DTensor's shard), as the backend declares it."""
    return grad if type(grad) is torch.Tensor else local_tensor(grad)


@contextlib.contextmanager
def _device_states_in_place(batch: PlannedBatch) -> Iterator[None]:
    """During its update a batch's ``state`` entries are the device copies; host mirrors again after.

    Swapping entries in place (rather than handing the adapter merged copies)
    keeps whatever the update writes to resident entries, at two dict stores per state. A state kept in a dict
    nested in its entry (``batch.nested_slots``) is found there before the update and again after it (the update may
    have put a new dict in its place).
    """
    if batch.nested_slots:
        with _nested_device_states_in_place(batch):
            yield
        return
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


@contextlib.contextmanager
def _nested_device_states_in_place(batch: PlannedBatch) -> Iterator[None]:
    """:func:`_device_states_in_place` with each slot's value located by its path in its entry."""
    for state, slot, view in zip(batch.slot_states, batch.slots, batch.update_views, strict=True):
        container, key = located(state, slot.key)
        container[key] = view
    try:
        yield
    except BaseException:
        for state, slot in zip(batch.slot_states, batch.slots, strict=True):
            container, key = located(state, slot.key)
            container[key] = slot.host_value
        raise
    for state, slot, view in zip(batch.slot_states, batch.slots, batch.update_views, strict=True):
        container, key = located(state, slot.key)
        value = container.get(key)
        if value is not view:
            _take_replaced_state(slot, view, value)
        container[key] = slot.host_value


def _with_grad(
    params: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    states: list[dict[str, Any] | None],
    sync: StateSync,
    creation: StateCreation,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[dict[str, Any]]]:
    """The parameters of a batch segment that have a gradient this step, with their gradients and states
    (``creation.missing_state`` for one that had no entry when the plan was made)."""
    kept_params, kept_grads, kept_states = [], [], []
    for param, grad, state in zip(params, grads, states, strict=True):
        if grad is None:
            continue
        if state is None:
            state = creation.missing_state(sync, param)
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
