"""fp32 master weights of bf16/fp16 parameters, kept as optimizer state and swapped with the others.

With ``SwapConfig(master_weights=True)`` every parameter in a low-precision floating dtype
(:data:`LOW_PRECISION_DTYPES`) gets an fp32 copy under the state key :data:`MASTER_KEY`. The
family's update runs on that copy, as if it were the parameter, with the gradient upcast to fp32
and fp32 states; the parameter is then set from it (``param.copy_(master)``, round to nearest
even). The reference, which the tests hold every family to bitwise, is the plain optimizer built
over fp32 leaf copies ``m = p.detach().float()``, each step ``m.grad = p.grad.float()``,
``step()``, then ``p.copy_(m)``.

The mechanism lives here once (the runtime calls it); adapters never see a low-precision parameter
in master mode, only its master, so none of them re-implements it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .errors import SwapStateError

__all__ = [
    "LOW_PRECISION_DTYPES",
    "MASTER_KEY",
    "MasterPair",
    "has_master",
    "master_problem",
    "master_state_dict",
    "on_masters",
    "set_params_from_masters",
    "stand_in",
    "without_master",
]

MASTER_KEY = "master_param"
"""The state key of a parameter's fp32 master copy."""

LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)
"""Parameter dtypes that get a master copy; every other parameter is updated as it is."""

MASTER_DTYPE = torch.float32

MasterPair = tuple[torch.Tensor, torch.Tensor]
"""``(parameter, its master's device copy)`` of one updated parameter."""


def has_master(param: torch.Tensor) -> bool:
    """Whether ``param`` gets an fp32 master copy in master-weights mode."""
    return param.dtype in LOW_PRECISION_DTYPES


def stand_in(param: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor with ``param``'s shape and device that holds one element (expanded).

    What an adapter's ``initial_state`` and ``state_mismatch`` are asked about in place of a
    low-precision parameter: the update runs on the master, so fresh states take its dtype, while
    only shape, dtype and device are read. Four bytes, whatever the parameter's size.
    """
    return torch.empty((), dtype=MASTER_DTYPE, device=param.device).expand(param.shape)


def without_master(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` without its master copy: what the family's own update reads."""
    return {key: value for key, value in state.items() if key != MASTER_KEY}


def master_problem(param: torch.Tensor, state: Mapping[str, Any]) -> str | None:
    """Why the non-empty ``state`` of a low-precision ``param`` cannot be used in master-weights mode, or ``None``.

    The master must be there, fp32 and shaped like the parameter, and every other floating state
    fp32 (the update runs on the master: torch's own load, for one, casts states to the parameter's
    dtype, which would silently lose the precision master weights exist for).
    """
    master = state.get(MASTER_KEY)
    if not isinstance(master, torch.Tensor):
        return f"has no {MASTER_KEY!r} (its fp32 master copy; it has {_keys(state)}){_LOAD_HINT}"
    if master.dtype != MASTER_DTYPE or tuple(master.shape) != tuple(param.shape):
        return (
            f"has {MASTER_KEY!r} of {master.dtype} and shape {tuple(master.shape)}, but the master of this "
            f"{param.dtype} parameter is {MASTER_DTYPE} of shape {tuple(param.shape)}{_LOAD_HINT}"
        )
    for key, value in state.items():
        if key == "step" or not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() == 0:
            continue
        if value.dtype != MASTER_DTYPE:
            return (
                f"has {key!r} in {value.dtype}, but with master weights every floating state is "
                f"{MASTER_DTYPE}{_LOAD_HINT}"
            )
    return None


_LOAD_HINT = (
    " (load checkpoints through the SwapOptimizer, which keeps them in fp32 and makes missing masters from the "
    "parameters: torch's own load_state_dict casts every state to the parameter's dtype)"
)


def on_masters(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], states: Sequence[Mapping[str, Any]]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[MasterPair]]:
    """What the update runs on: each low-precision parameter's master and its gradient in fp32.

    Other parameters (fp32 ones) pass unchanged. The masters are the device copies ``states``
    hold during the batch. Returns the update's parameters and gradients, and the pairs to copy
    back with :func:`set_params_from_masters` once the update ran.
    """
    update_params: list[torch.Tensor] = []
    update_grads: list[torch.Tensor] = []
    pairs: list[MasterPair] = []
    for param, grad, state in zip(params, grads, states, strict=True):
        if not has_master(param):
            update_params.append(param)
            update_grads.append(grad)
            continue
        master = state.get(MASTER_KEY)
        if not isinstance(master, torch.Tensor):  # never update the low-precision parameter itself instead
            raise SwapStateError(
                f"The {param.dtype} parameter of shape {tuple(param.shape)} has no {MASTER_KEY!r} in its state "
                f"(it has {_keys(state)}): master weights cannot update it (the step checks every state before any "
                "batch; was the state edited during the step?)"
            )
        update_params.append(master)
        update_grads.append(grad.to(MASTER_DTYPE))
        pairs.append((param, master))
    return update_params, update_grads, pairs


def set_params_from_masters(pairs: Sequence[MasterPair]) -> None:
    """``param.copy_(master)`` for each pair: the parameter rounds its updated master to nearest even."""
    with torch.no_grad():
        for param, master in pairs:
            param.copy_(master)


def master_state_dict(module: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> dict[str, Any]:
    """``module.state_dict()`` with each parameter that has a master replaced by a copy of that fp32 master.

    For a final full-precision export of a model trained with ``master_weights=True``: keys and
    everything else (fp32 parameters, buffers) are ``module.state_dict()``'s; a master is looked up
    in the state of whichever of ``optimizers`` holds the parameter. Each optimizer is synchronized
    first (a swapped master is read from its host mirror); the values are new CPU tensors.
    """
    masters: dict[int, torch.Tensor] = {}
    for optimizer in optimizers:
        synchronize = getattr(optimizer, "synchronize", None)
        if callable(synchronize):
            synchronize()
        for param, state in optimizer.state.items():
            master = state.get(MASTER_KEY)
            if isinstance(master, torch.Tensor):
                masters[id(param)] = master
    names = {id(param): name for name, param in module.named_parameters(remove_duplicate=False)}
    exported = dict(module.state_dict())
    for param_id, master in masters.items():
        name = names.get(param_id)
        if name is not None and name in exported:
            exported[name] = master.detach().to("cpu", copy=True)
    return exported


def _keys(state: Mapping[str, Any]) -> str:
    return ", ".join(repr(key) for key in state) or "no keys"
