"""Masters in checkpoints: made from the parameters when a checkpoint has none, checked when it has them, and set
aside while a state is checked without them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..adapters.base import StateInit
from ..errors import StateDictMismatchError
from ..runtime.slots import SwapSlot
from ..runtime.state_keys import MASTER_KEY
from ..runtime.store import StateSource, StateStore

__all__ = ["check_master_shape", "master_from_param", "masters_set_aside", "unexpected_master"]


def master_from_param(store: StateStore, new: list[tuple[SwapSlot, StateSource]], param: torch.Tensor) -> Any:
    """A master copy of ``param`` itself: swapped (filled from the parameter, cast on the way to host memory,
    one parameter at a time) or resident (an fp32 device copy)."""
    template = StateInit(tuple(param.shape), torch.float32)
    if store.should_swap(MASTER_KEY, template):
        new.append((SwapSlot.sharded_like(param, MASTER_KEY, torch.float32), param.detach()))
        return template
    return store.resident_copy(param.detach().float())


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
    """``optimizer.state`` without the fp32 masters for the duration (put back whatever happens)."""
    masters: list[tuple[dict[str, Any], Any]] = []
    for state in optimizer.state.values():
        if isinstance(state, dict) and MASTER_KEY in state:
            masters.append((state, dict.pop(state, MASTER_KEY)))
    try:
        yield
    finally:
        for state, master in masters:
            dict.__setitem__(state, MASTER_KEY, master)
