"""Read-only views of the batches a :class:`~swap_core.SwapOptimizer` steps: what each moves, and which parameters
update first with no state to move. Benchmarks and tests read the plan through them, never through the optimizer's
own plan object::

    from swap_core.views import planned_batches

    batches = planned_batches(opt)                  # what the next step moves, batch by batch
    copies = sum(len(batch.copy_bytes) for batch in batches)
"""

from __future__ import annotations

import dataclasses

import torch

from .optimizer import SwapOptimizer
from .runtime.plan import SwapPlan

__all__ = ["BatchView", "PlannedState", "planned_batches", "planned_resident_params"]


@dataclasses.dataclass(frozen=True)
class PlannedState:
    """One swapped state tensor of a batch."""

    param: torch.Tensor
    key: str
    dtype: torch.dtype
    nbytes: int
    """Bytes of the state itself (of the local shard for a DTensor parameter), without alignment padding."""


@dataclasses.dataclass(frozen=True)
class BatchView:
    """One pipeline batch: the parameters it updates together and the copies that bring their states."""

    params: tuple[torch.Tensor, ...]
    """In param-group order; consecutive in that order among the parameters with a swapped state (those without
    one update first, in no batch: :func:`planned_resident_params`)."""
    states: tuple[PlannedState, ...]
    copy_bytes: tuple[int, ...]
    """Bytes of each host-to-device copy of the batch (one per dtype packed, one per state otherwise);
    the device-to-host copies that follow the update have the same sizes."""


def planned_batches(optimizer: SwapOptimizer) -> tuple[BatchView, ...]:
    """The batches ``optimizer.step()`` runs next, as it would plan them now.

    Planning checks the states as a step does, so a state the update cannot use raises the
    step's :class:`~swap_core.errors.SwapStateError` here too. An optimizer over CPU
    parameters swaps nothing and has no batches: that raises ``ValueError``. The batches come in the
    order the step walks them (the last parameters first with ``SwapConfig(prefetch="backward")``).
    """
    plan = _plan_of(optimizer, "planned_batches")
    return tuple(
        BatchView(
            params=tuple(param for _, param in batch.params),
            states=tuple(PlannedState(slot.param, slot.key, slot.dtype, slot.nbytes) for slot in batch.slots),
            copy_bytes=tuple(host.numel() * host.element_size() for host, _ in batch.transfers),
        )
        for batch in plan.batches
    )


def planned_resident_params(optimizer: SwapOptimizer) -> tuple[torch.Tensor, ...]:
    """The parameters ``optimizer.step()`` updates first, before batch 0 (no state of theirs is swapped).

    Planned as :func:`planned_batches` plans (and raising as it does); empty when nothing is swapped at all
    (then the one batch holds every parameter) or when the adapter batches by rank-independent costs.
    """
    plan = _plan_of(optimizer, "planned_resident_params")
    return tuple(param for _, param in plan.resident.params) if plan.resident is not None else ()


def _plan_of(optimizer: SwapOptimizer, caller: str) -> SwapPlan:
    if not isinstance(optimizer, SwapOptimizer):
        raise TypeError(f"{caller}() takes a SwapOptimizer, got {type(optimizer).__name__}")
    return optimizer.swap_plan()
