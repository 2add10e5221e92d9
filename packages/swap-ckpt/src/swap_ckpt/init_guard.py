"""Optimizer states before DCP reads or writes them, without torch's state-initializing step.

``torch.distributed.checkpoint.state_dict`` creates missing optimizer state by
running ``optimizer.step()`` with zero gradients and lr 0, but only on ranks
whose optimizer has no state and no gradient. Swapped optimizers get their
states without a step instead (:func:`initialize_swapped_states`). For plain
optimizers, ranks that disagree on the step would diverge (or hang, if the
step runs collectives): :func:`check_uniform_state_init` turns that into an
error on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from swap_core import SwapOptimizer

from .errors import StateInitDivergenceError

__all__ = ["check_uniform_state_init", "initialize_swapped_states", "needs_state_init"]


def needs_state_init(optimizer: torch.optim.Optimizer) -> bool:
    """Whether torch's ``_init_optim_state`` would run ``optimizer.step()`` (its exact condition)."""
    if optimizer.state:
        return False
    return all(param.grad is None for group in optimizer.param_groups for param in group["params"])


def initialize_swapped_states(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Give every swapped optimizer without state its states now, so torch never runs its initializing step.

    ``SwapOptimizer.initialize_state`` creates the states the first step starts from (swapped ones
    born in host memory): no device traffic, no update, no collective. It runs whether or not
    gradients exist (torch skips its step then), so every rank ends up with states alike. Deliberately
    not torch's result for a never-stepped optimizer: its fake step counts (Adam saves ``step`` 1, so a
    run resumed from it bias-corrects its first real step as the second), while this state resumes
    exactly like the uninterrupted run. A loaded checkpoint replaces it entirely.
    """
    for optimizer in optimizers:
        if isinstance(optimizer, SwapOptimizer) and optimizer.backend is not None and not optimizer.state:
            optimizer.initialize_state()


def check_uniform_state_init(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Raise on every rank if the ranks disagree on which optimizers need the initializing step."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    local = [needs_state_init(optimizer) for optimizer in optimizers]
    gathered: list[list[bool] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    for index in range(len(optimizers)):
        stepping = [rank for rank, flags in enumerate(gathered) if flags is not None and flags[index]]
        if stepping and len(stepping) != len(gathered):
            raise StateInitDivergenceError(
                f"Optimizer {index} ({type(optimizers[index]).__name__}) has no state on ranks {stepping} only: "
                "torch would initialize it with a step on those ranks alone. Step every rank at least once "
                "(or on none) before saving or loading, and clear gradients on all ranks alike"
            )
