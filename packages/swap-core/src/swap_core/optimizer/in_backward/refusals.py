"""What the step inside the backward refuses, and warns of, in words: each message says what happened, what the
plain loop would have done, and the fix."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...errors import SwapStateError
from ...user_warnings import warn_user
from ..state_sync import StateSync

__all__ = [
    "LATER_BACKWARD",
    "grad_scaler_refused",
    "params_written_refused",
    "refuse_what_changed_after_the_fact",
    "warn_of_stateless_params",
]

LATER_BACKWARD = (
    "A backward began while the updates of the step begun inside an earlier backward were not committed "
    "(no step() and no zero_grad() since: SwapConfig(step='in_backward')), so the forward before it ran on "
    "parameters updated provisionally. They are taken back now; the loss of this backward is not torch's. "
    "Call step() (or zero_grad() to skip the step) after each backward, and run the backwards of the "
    "micro-batches before the last one inside `with opt.accumulating():`"
)


def params_written_refused(edited: Sequence[torch.Tensor]) -> SwapStateError:
    """Parameters written between ``backward()`` and ``step()`` after their provisional update."""
    return SwapStateError(
        f"{len(edited)} parameter(s) were written between backward() and step() (the first of shape "
        f"{tuple(edited[0].shape)}) after their provisional update inside the backward "
        "(SwapConfig(step='in_backward')): torch's step would update the written values, but the update came "
        "first. The step is taken back, with the write. Write parameters after step(), or use "
        "step='after_backward'"
    )


def refuse_what_changed_after_the_fact(changed: Sequence[str], edited: Sequence[torch.Tensor], updated: int) -> None:
    """Without provisional updates: hyperparameters ``changed`` or gradients ``edited`` after the ``updated`` batches
    updated inside the backward are refused (the step ended with what it began with)."""
    if changed:
        raise SwapStateError(
            f"{len(changed)} hyperparameter(s) changed between the backward that updated {updated} batch(es) and "
            f"step() ({changed[0]}): with SwapConfig(step='in_backward', provisional_updates=False) those batches "
            "used the values the backward began with, and so did the rest of this step; the new values apply from "
            "the next step. Change them after step() (step LR schedulers after opt.step(); no step pre-hook that "
            "sets them), or keep provisional_updates=True"
        )
    if edited:
        raise SwapStateError(
            f"{len(edited)} gradient(s) changed after their batch updated inside the backward (e.g. the first "
            f"of shape {tuple(edited[0].shape)}): clip_grad_norm_, GradScaler or any edit of the gradients "
            "between backward() and step() comes too late with SwapConfig(step='in_backward', "
            "provisional_updates=False), and those updates used the gradients as the backward left them. Keep "
            "provisional_updates=True, or edit gradients with step='after_backward'"
        )


def grad_scaler_refused(*, updated: bool) -> SwapStateError:
    """``GradScaler`` without provisional updates (``updated``: batches updated inside the backward already)."""
    return SwapStateError(
        "GradScaler cannot drive SwapConfig(step='in_backward', provisional_updates=False): the batches update "
        "inside the backward, before GradScaler can unscale the gradients or skip a step whose gradients hold "
        "inf or NaN. "
        + (
            "This step's batches updated inside the backward with the scaled gradients. "
            if updated
            else "Nothing was updated. "
        )
        + "Keep provisional_updates=True, or use step='after_backward' (bf16 autocast needs no scaler)"
    )


def warn_of_stateless_params(sync: StateSync) -> bool:
    """Warn that the steps run after the backward while some parameters have no state and get none now (they had
    no gradient yet); whether it warned."""
    if not sync.state:
        return False
    stateless = [
        param
        for param in sync.ordered_params()
        if param.requires_grad and param.grad is None and not sync.state.get(param)  # with a gradient: one now
    ]
    if not stateless:
        return False
    warn_user(
        f"SwapConfig(step='in_backward'): {len(stateless)} parameter(s) have no optimizer state yet (they "
        f"never had a gradient; the first of shape {tuple(stateless[0].shape)}), so the steps run after the "
        "backward until every parameter has one; parameters that never take a gradient should not require "
        "one (requires_grad_(False)) or be left out of the optimizer",
        UserWarning,
    )
    return True
