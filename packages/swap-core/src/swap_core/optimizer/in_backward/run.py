"""A step whose batches update inside the backward: each batch reads its own gradients once they are final."""

from __future__ import annotations

import torch

from ...backends.protocol import Stream
from ...runtime.plan import PlannedBatch
from ..plan_cache import PlanCache
from ..setup import SwapSetup
from ..state_sync import StateSync
from ..step_run import StepRun, local_grad, sparse_gradient
from .gradient_watch import GradientWatch

__all__ = ["InBackwardRun"]


class InBackwardRun(StepRun):
    """:class:`~swap_core.optimizer.step_run.StepRun` of a step begun inside the backward: no gradient is read when
    it is planned; each batch reads its own at its update, and they are noted so that ``step()`` can tell whether one
    was edited since (:meth:`edited_gradients`)."""

    def __init__(self, setup: SwapSetup, sync: StateSync, plans: PlanCache) -> None:
        super().__init__(setup, sync, plans)
        self._applied = GradientWatch()
        """Each parameter a batch updated, with the gradient it used."""
        self._positions: dict[int, int] = {}

    def release(self) -> None:
        super().release()
        self._applied, self._positions = GradientWatch(), {}

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
        super().update(batch)

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
        return self._applied.changed()
