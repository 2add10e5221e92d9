"""A step whose batches update inside the backward: each batch reads its own gradients once they are final."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...backends.protocol import Event, Stream
from ...runtime.plan import PlannedBatch
from ...runtime.state_keys import MASTER_KEY
from ...runtime.update_undo import UpdateUndo
from ...torch_compat import tensor_version
from ..plan_cache import PlanCache
from ..setup import SwapSetup
from ..state_sync import StateSync
from ..step_run import StepRun, local_grad, sparse_gradient
from .gradient_watch import GradientWatch

__all__ = ["InBackwardRun"]


class InBackwardRun(StepRun):
    """:class:`~swap_core.optimizer.step_run.StepRun` of a step begun inside the backward: no gradient is read when
    it is planned; each batch reads its own at its update, and they are noted so that ``step()`` can tell whether one
    was edited since (:meth:`edited_gradients`). With provisional updates, what taking each batch back needs is kept
    (:meth:`keep_params` when it is copied in, its resident states right before its update)."""

    def __init__(self, setup: SwapSetup, sync: StateSync, plans: PlanCache, undo: UpdateUndo | None) -> None:
        """``undo``: where each batch keeps its parameters and resident states before its update, when the step's
        updates are provisional."""
        super().__init__(setup, sync, plans)
        self._undo = undo
        self.journals_every_step = undo is None  # a provisional step that fails is taken back whole
        self._applied = GradientWatch()
        """Each parameter a batch updated, with the gradient it used."""
        self._positions: dict[int, int] = {}
        self._updated: list[tuple[torch.Tensor, int]] = []
        """Each parameter a batch updated, with its version right after (an edit since shows there)."""
        self._kept: dict[int, Event | None] = {}
        """The copy of each batch's parameters issued with its copy-in, by batch index, until its update."""
        self._grown: list[torch.Tensor] = []
        """Parameters whose existing states a batch's update added keys to, moved to host memory once the step
        ended (:meth:`move_grown_states`)."""

    def release(self) -> None:
        super().release()
        self._applied, self._positions, self._updated, self._kept = GradientWatch(), {}, [], {}

    def _read_gradients(self, ordered: list[torch.Tensor]) -> int:
        """None yet: each batch reads its own when they are final."""
        self.grads = [None] * len(ordered)
        return 0

    def update(self, batch: PlannedBatch) -> None:
        """The batch's gradients read now (they are final), then its update."""
        ordered, grads = self._ordered, self.grads
        adopt = self.setup.backend.adopt
        for group_index, _, _, where in batch.segments:
            for position in range(len(grads))[where] if isinstance(where, slice) else where:
                param = ordered[position]
                grad = grads[position] = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise sparse_gradient(group_index, param)
                adopt(local_grad(grad))
                self._applied.note(param, grad)
                self._positions[id(param)] = position
        if self._undo is not None:
            self._keep_states(batch)
        super().update(batch)
        self._updated += [(param, tensor_version(param)) for _, param in batch.params if param.grad is not None]

    def keep_params(self, batch: PlannedBatch) -> None:
        """``batch``'s copy-in is issued: keep what its update will write to its parameters, beside the copy (those
        with an fp32 master need nothing: they are their master rounded, and the master's mirror keeps it)."""
        assert self._undo is not None
        masters = {id(slot.param): slot for slot in batch.slots if slot.key == MASTER_KEY}
        copied = []
        for _, param in batch.params:
            if not param.requires_grad and param.grad is None:
                continue  # never updated
            master = masters.get(id(param))
            if master is not None:
                self._undo.keep_from_master(param, master.host_mirror)
            else:
                copied.append(param)
        scheduler = self.setup.scheduler
        self._kept[batch.index] = self._undo.keep_params(copied, compute=scheduler.compute, copy_stream=scheduler.d2h)

    def _keep_states(self, batch: PlannedBatch) -> None:
        """Right before the update: its parameters' copies waited for, their resident states kept."""
        assert self._undo is not None
        self._undo.wait_for_params(self._kept.pop(batch.index, None), compute=self.setup.scheduler.compute)
        swapped: dict[int, set[str]] = {}
        for slot in batch.slots:
            swapped.setdefault(id(slot.param), set()).add(slot.key)
        state = self.sync.state
        updated = [param for _, param in batch.params if param.grad is not None]
        self._undo.keep_states((state[param], frozenset(swapped.get(id(param), ()))) for param in updated)

    def _move_made_states(self, fresh: list[torch.Tensor], grown: list[torch.Tensor]) -> None:
        """Keys an update added to existing states wait on the device for the step to end (a provisional walk's store
        is not added to: its commit makes every slot's spare copy current); no state is made inside the backward."""
        self._grown += grown
        if fresh:
            super()._move_made_states(fresh, [])

    def move_grown_states(self) -> None:
        """The step ended (committed, or run as it began): the keys its updates added to existing states go to host
        memory, as after a step after the backward."""
        grown, self._grown = self._grown, []
        if grown:
            self.sync.offload_existing_states(grown)

    def _keep_beside(self, params: Sequence[torch.Tensor]) -> None:
        """Kept for a take-back too (provisional updates)."""
        super()._keep_beside(params)
        if self._undo is not None:
            self._undo.keep_states(self.entries_with_swapped_keys(params))

    def edited_params(self) -> list[torch.Tensor]:
        """The parameters written since their batch updated them (by the user, between backward() and step())."""
        return [param for param, version in self._updated if tensor_version(param) != version]

    def applied(self, param: torch.Tensor) -> bool:
        """Whether a batch of this step updated ``param`` with its gradient already."""
        return param in self._applied

    def free_gradients(self, batch: PlannedBatch, *, allocated_on: Stream) -> None:
        """Drop the gradients ``batch`` updated with, the parameters' (``p.grad = None``) and this step's references
        (its issued update holds them until it ran); :meth:`edited_gradients` then expects ``None`` there.
        ``allocated_on``: the stream torch made them under (the hooks'): their blocks are kept from its pool until
        the update, issued to the steps' stream, is done (``DeviceBackend.free_when_done``)."""
        backend, steps = self.setup.backend, self.setup.scheduler.compute
        for _, param in batch.params:
            if self._applied.drop(param):
                position = self._positions[id(param)]
                grad = self.grads[position]
                if grad is not None and allocated_on != steps:
                    backend.free_when_done(local_grad(grad), allocated_on=allocated_on, in_use_on=steps)
                self.grads[position] = None

    def edited_gradients(self) -> list[torch.Tensor]:
        """The parameters whose gradient was replaced or written in place since its batch updated with it (or set
        again after :meth:`free_gradients` dropped it)."""
        return self._applied.changed(self.setup.backend.read_to_host)
