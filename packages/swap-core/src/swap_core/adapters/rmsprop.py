"""Adapter for ``torch.optim.RMSprop``: the reference adapter swap-core ships and tests itself with.

Each batch runs through ``torch.optim.rmsprop.rmsprop``, the same function
``RMSprop.step`` calls, with the group's own options, so results are bitwise
those of the unwrapped optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.rmsprop import rmsprop

from ..errors import UnsupportedOptimizerError
from .base import StateInit, StateSwapAdapter, UpdateBatch, refuse_differentiable

__all__ = ["RMSpropAdapter", "register"]


class RMSpropAdapter(StateSwapAdapter):
    """Swaps ``square_avg``, ``momentum_buffer`` and ``grad_avg`` of RMSprop."""

    swappable_keys = ("square_avg", "momentum_buffer", "grad_avg")
    reproduces = (torch.optim.RMSprop,)

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        for index, group in enumerate(optimizer.param_groups):
            _check_group(group, index)

    def initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor | StateInit]:
        _check_group(group, None)
        state: dict[str, torch.Tensor | StateInit] = {
            "step": torch.zeros((), dtype=_step_dtype()),
            "square_avg": StateInit.zeros_like(param),
        }
        if group["momentum"] > 0:
            state["momentum_buffer"] = StateInit.zeros_like(param)
        if group["centered"]:
            state["grad_avg"] = StateInit.zeros_like(param)
        return state

    def update(self, batch: UpdateBatch) -> None:
        group = batch.group
        states = batch.states
        rmsprop(
            batch.params,
            batch.grads,
            [state["square_avg"] for state in states],
            [state["grad_avg"] for state in states] if group["centered"] else [],
            [state["momentum_buffer"] for state in states] if group["momentum"] > 0 else [],
            [state["step"] for state in states],
            lr=group["lr"],
            alpha=group["alpha"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            centered=group["centered"],
            foreach=group["foreach"],
            maximize=group["maximize"],
            differentiable=group["differentiable"],
            capturable=group["capturable"],
            has_complex=any(torch.is_complex(param) for param in batch.params),
        )


def _step_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _check_group(group: dict[str, Any], index: int | None) -> None:
    refuse_differentiable("RMSprop", group, index)
    if group.get("capturable", False):
        where = f"param group {index}" if index is not None else "a param group"
        raise UnsupportedOptimizerError(
            f"RMSprop with capturable=True in {where} cannot be swapped; create the optimizer with capturable=False"
        )


def register(registry: Any) -> None:
    """Entry point of the ``swap_core.adapters`` group for RMSprop."""
    registry.register(torch.optim.RMSprop, RMSpropAdapter, name="rmsprop")
