"""Masters in checkpoints: made from the parameters when a checkpoint has none, checked when it has them, and set
aside while a state is checked without them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..adapters.base import StateInit
from ..dtensor import local_tensor
from ..errors import StateDictMismatchError
from ..runtime.slots import SwapSlot
from ..runtime.state_keys import MASTER_KEY, MASTER_KEYS, REMAINDER_KEY
from ..runtime.store import StateSource, StateStore
from .remainder import MasterRemainder, remainder_nbytes, split_master

__all__ = [
    "check_master_shape",
    "loaded_remainder",
    "master_from_param",
    "masters_set_aside",
    "remainder_value",
    "unexpected_master",
]


def master_from_param(
    store: StateStore, new: list[tuple[SwapSlot, StateSource]], param: torch.Tensor, *, as_remainder: bool
) -> tuple[str, Any]:
    """A master copy of ``param`` itself, and its key: swapped (filled from the parameter, cast on the way to host
    memory, one parameter at a time) or resident (an fp32 device copy); ``as_remainder``: as its remainder, all
    zeros (the parameter is its master, exactly)."""
    if as_remainder:
        zeros = torch.zeros(remainder_nbytes(local_tensor(param).numel()), dtype=torch.uint8)  # of the local shard
        return REMAINDER_KEY, remainder_value(store, new, param, zeros)
    template = StateInit(tuple(param.shape), torch.float32)
    if store.should_swap(MASTER_KEY, template):
        new.append((SwapSlot.sharded_like(param, MASTER_KEY, torch.float32), param.detach()))
        return MASTER_KEY, template
    return MASTER_KEY, store.resident_copy(param.detach().float())


def loaded_remainder(param: torch.Tensor, master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A loaded fp32 ``master`` of the bf16 ``param`` as its packed remainder (on the host), and the parameter it is
    the remainder over: torch's cast of the master, which the load sets ``param`` to (the master's top bits live in
    the parameter). A master saved in a lower precision is taken from its rounded values, as in the fp32 form. Of a
    DTensor, both are of this rank's local shard."""
    fp32 = local_tensor(master.detach()).to("cpu", torch.float32, copy=True).contiguous()
    local = local_tensor(param)
    if fp32.shape != local.shape:
        raise StateDictMismatchError(
            f"Loaded state dict: {MASTER_KEY!r} has a local shard of shape {tuple(fp32.shape)}, but this rank's shard "
            f"of its parameter has shape {tuple(local.shape)}; nothing was loaded"
        )
    cast = fp32.to(torch.bfloat16)
    packed = torch.empty(remainder_nbytes(fp32.numel()), dtype=torch.uint8)
    split_master(fp32, cast, out=MasterRemainder.packed(packed, fp32.numel()))
    return packed, cast


def remainder_value(
    store: StateStore, new: list[tuple[SwapSlot, StateSource]], param: torch.Tensor, packed: torch.Tensor
) -> Any:
    """The state value of ``param``'s packed remainder ``packed`` (host bytes): swapped (placed later, from
    ``new``) or resident (a device copy)."""
    template = StateInit(tuple(packed.shape), torch.uint8, shard_like_param=False)
    if store.should_swap(REMAINDER_KEY, template):
        new.append((SwapSlot.whole(param, REMAINDER_KEY, packed.shape, torch.uint8), packed))
        return template
    return store.resident_copy(packed)


def check_master_shape(saved_id: object, param: torch.Tensor, master: object) -> None:
    """Refuse a loaded master whose shape is not its parameter's, naming both."""
    shape = tuple(master.shape) if isinstance(master, torch.Tensor) else None
    if shape != tuple(param.shape):
        got = f"shape {shape}" if shape is not None else f"a {type(master).__name__}"
        raise StateDictMismatchError(
            f"Loaded state dict: the state of parameter {saved_id!r} has {MASTER_KEY!r} of {got}, but its parameter "
            f"has shape {tuple(param.shape)}; nothing was loaded"
        )


def unexpected_master(saved_id: object, param: torch.Tensor, *, master_weights: bool) -> str:
    """Why a loaded state with a master cannot load into a parameter that keeps none."""
    where = f"Loaded state dict: the state of parameter {saved_id!r} has {MASTER_KEY!r} (an fp32 master copy)"
    if master_weights:
        return f"{where}, but the parameter is {param.dtype}, which keeps no master; nothing was loaded"
    return (
        f"{where}: it was saved with master_weights=True. Load it with SwapConfig(master_weights=True), or into "
        "the plain optimizer (torch's load keeps the key and casts every state to the parameter's dtype); "
        "nothing was loaded"
    )


@contextlib.contextmanager
def masters_set_aside(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """``optimizer.state`` without the masters, in either form, for the duration (put back whatever happens)."""
    masters: list[tuple[dict[str, Any], str, Any]] = []
    for state in optimizer.state.values():
        if isinstance(state, dict):
            masters.extend((state, key, dict.pop(state, key)) for key in MASTER_KEYS if key in state)
    try:
        yield
    finally:
        for state, key, master in masters:
            dict.__setitem__(state, key, master)
