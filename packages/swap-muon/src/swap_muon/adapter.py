"""Adapter for ``torch.optim.Muon``: its ``momentum_buffer`` lives in host memory between steps.

Each batch runs through ``torch.optim._muon.muon`` (fenced in :mod:`swap_muon.torch_compat`), the
function ``Muon.step`` calls, with exactly the keyword arguments ``step`` passes, on the batch's subset
of parameters. Muon updates every parameter independently (momentum, then
Newton-Schulz on that one matrix, then the step), so a subset update is bitwise
the update of the whole group.
"""

from __future__ import annotations

from typing import Any

import torch

from swap_core.adapters.base import StateInit, StateSwapAdapter, UpdateBatch
from swap_core.adapters.registry import AdapterRegistry

try:
    from torch.optim import Muon
except ImportError as error:  # pragma: no cover - depends on the installed torch
    raise ImportError(
        f"swap-muon adapts torch.optim.Muon, which torch {torch.__version__} does not have; install torch>=2.9"
    ) from error

from .torch_compat import muon

__all__ = ["MuonAdapter", "register"]

_COMPLEX_MESSAGE = "Muon does not support complex parameters"
"""``Muon._init_group``'s own message, so a swapped optimizer fails as the plain one does."""


class MuonAdapter(StateSwapAdapter):
    """Swaps Muon's one state, ``momentum_buffer`` (the size of the parameter)."""

    swappable_keys = ("momentum_buffer",)
    reproduces = (Muon,)

    def initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor | StateInit]:
        # Muon creates zeros_like(grad) on a parameter's first step; a gradient has its
        # parameter's shape and dtype, and there is no step counter.
        return {"momentum_buffer": StateInit.zeros_like(param)}

    def update(self, batch: UpdateBatch) -> None:
        group = batch.group
        # Muon refuses a complex group before touching any of its parameters; refusing the
        # whole batch keeps the parameters of this batch untouched in the same way.
        if any(torch.is_complex(param) for param in batch.params):
            raise RuntimeError(_COMPLEX_MESSAGE)
        muon(
            batch.params,
            batch.grads,
            [state["momentum_buffer"] for state in batch.states],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
            ns_coefficients=group["ns_coefficients"],
            eps=group["eps"],
            ns_steps=group["ns_steps"],
            adjust_lr_fn=group["adjust_lr_fn"],
            has_complex=False,  # what Muon._init_group always returns once it let the group through
        )


def make_muon_adapter(optimizer: torch.optim.Optimizer) -> StateSwapAdapter:
    """The Muon adapter for ``optimizer``: owner-rank Muon when its parameters are DTensors (FSDP2, HSDP)."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if any(isinstance(param, DTensor) for param in params):
            from .distributed import DistributedMuonAdapter

            return DistributedMuonAdapter(optimizer)
    return MuonAdapter(optimizer)


def register(registry: AdapterRegistry) -> None:
    """Entry point of the ``swap_core.adapters`` group: serve ``torch.optim.Muon`` (and subclasses)."""
    registry.register(Muon, make_muon_adapter, name="muon")
