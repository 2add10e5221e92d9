"""Which parameters keep an fp32 master, the fp32 stand-in the adapters are asked about, and a master state's checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..dtensor import local_tensor
from ..runtime.state_keys import MASTER_KEY, MASTER_KEYS, REMAINDER_KEY
from .remainder import has_remainder_form, remainder_nbytes

__all__ = [
    "LOW_PRECISION_DTYPES",
    "MASTER_DTYPE",
    "MasterPair",
    "has_master",
    "keeps_remainder",
    "listed_keys",
    "master_problem",
    "model_param",
    "remainder_problem",
    "stand_in",
    "without_master",
]


LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)
"""Parameter dtypes that get a master copy; every other parameter is updated as it is."""

MASTER_DTYPE = torch.float32
"""The dtype of every master, and of every floating state beside one."""

_STOOD_FOR = WeakIdKeyDictionary()
"""Each live stand-in's parameter (by the stand-in's identity; an entry goes with its stand-in)."""

MasterPair = tuple[torch.Tensor, torch.Tensor]
"""``(parameter, its master's device copy)`` of one updated parameter."""


def has_master(param: torch.Tensor) -> bool:
    """Whether ``param`` gets an fp32 master copy in master-weights mode."""
    return param.dtype in LOW_PRECISION_DTYPES


def keeps_remainder(param: torch.Tensor) -> bool:
    """Whether ``param``'s master can be kept as its remainder (:mod:`~swap_core.master_weights.remainder`): a bf16
    parameter (of a DTensor, its local shard) in contiguous memory, so that its master is too (a channels-last
    parameter keeps an fp32 master in its own memory order)."""
    return has_remainder_form(param.dtype) and local_tensor(param).is_contiguous()


def stand_in(param: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor with ``param``'s shape and device that holds one element (expanded).

    What an adapter's ``initial_state`` and ``state_mismatch`` are asked about in place of a
    low-precision parameter: the update runs on the master, so fresh states take its dtype, while
    only shape, dtype and device are read. Four bytes, whatever the parameter's size. An adapter
    that knows parameters by identity finds ``param`` again with :func:`model_param`.
    """
    fp32 = torch.empty((), dtype=MASTER_DTYPE, device=param.device).expand(param.shape)
    _STOOD_FOR[fp32] = param
    return fp32


def model_param(tensor: torch.Tensor) -> torch.Tensor:
    """The parameter ``tensor`` stands in for, if it is a :func:`stand_in`; else ``tensor`` itself."""
    param: torch.Tensor | None = _STOOD_FOR.get(tensor)  # type: ignore[no-untyped-call]
    return tensor if param is None else param


def without_master(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` without its master copy (in either form): what the family's own update reads."""
    return {key: value for key, value in state.items() if key not in MASTER_KEYS}


def master_problem(param: torch.Tensor, state: Mapping[str, Any]) -> str | None:
    """Why the non-empty ``state`` of a low-precision ``param`` cannot be used in master-weights mode, or ``None``.

    The master must be there, fp32 and shaped like the parameter, and every other floating state
    fp32 (the update runs on the master: torch's own load, for one, casts states to the parameter's
    dtype, which would silently lose the precision master weights exist for).
    """
    master = state.get(MASTER_KEY)
    if not isinstance(master, torch.Tensor):
        return f"has no {MASTER_KEY!r} (its fp32 master copy; it has {listed_keys(state)}){_LOAD_HINT}"
    if master.dtype != MASTER_DTYPE or tuple(master.shape) != tuple(param.shape):
        return (
            f"has {MASTER_KEY!r} of {master.dtype} and shape {tuple(master.shape)}, but the master of this "
            f"{param.dtype} parameter is {MASTER_DTYPE} of shape {tuple(param.shape)}{_LOAD_HINT}"
        )
    return _fp32_states_problem(state)


def remainder_problem(param: torch.Tensor, state: Mapping[str, Any]) -> str | None:
    """Why the non-empty ``state`` of a bf16 ``param`` whose master is kept as its remainder cannot be used, or
    ``None``: the remainder must be there, ``uint8`` of :func:`~swap_core.master_weights.remainder.remainder_nbytes`
    bytes, with no fp32 master beside it, and every other floating state fp32."""
    packed = state.get(REMAINDER_KEY)
    nbytes = remainder_nbytes(local_tensor(param).numel())
    if not isinstance(packed, torch.Tensor) or MASTER_KEY in state:
        return (
            f"has no {REMAINDER_KEY!r} (its master's remainder; it has {listed_keys(state)}){_LOAD_HINT}"
            if MASTER_KEY not in state
            else f"has an fp32 {MASTER_KEY!r} where its master is kept as {REMAINDER_KEY!r}{_LOAD_HINT}"
        )
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (nbytes,):
        return (
            f"has {REMAINDER_KEY!r} of {packed.dtype} and shape {tuple(packed.shape)}, but the remainder of this "
            f"parameter's master is uint8 of shape ({nbytes},){_LOAD_HINT}"
        )
    return _fp32_states_problem(state)


def _fp32_states_problem(state: Mapping[str, Any]) -> str | None:
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


def listed_keys(state: Mapping[str, Any]) -> str:
    """The keys of ``state``, for an error message."""
    return ", ".join(repr(key) for key in state) or "no keys"
