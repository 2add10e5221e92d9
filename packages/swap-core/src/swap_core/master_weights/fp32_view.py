"""Masters kept as remainders, seen as fp32 masters: by a reader of the state and in every checkpoint.

A bf16 parameter's master in remainder form (``"master_remainder"``) is only whole beside the parameter, so what
leaves the optimizer joins the two on the host: :func:`master_of` for one parameter, :func:`fp32_masters` for a
state dict (``state_dict()`` runs it: checkpoints hold ``"master_param"`` in fp32 whichever form the live state
keeps, and load anywhere a master-weights checkpoint loads).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..dtensor import local_tensor, shard_layout, wrap_local
from ..runtime.state_keys import MASTER_KEY, REMAINDER_KEY
from .remainder import MasterRemainder, rebuild_master

__all__ = ["fp32_masters", "joined_master", "master_of", "with_fp32_master"]


def joined_master(param: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """The fp32 master ``param`` (bf16) and its packed remainder ``packed`` keep, as a new CPU tensor (the master
    the next step would update, :func:`~swap_core.master_weights.remainder.rebuild_master`); of a DTensor, a DTensor
    of its layout over the joined local shard, as the fp32 form's host mirror is."""
    host_param = local_tensor(param.detach()).to("cpu", copy=True)
    remainder = MasterRemainder.packed(local_tensor(packed.detach()).to("cpu"), host_param.numel())
    return wrap_local(rebuild_master(host_param, remainder), shard_layout(param))


def master_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor | None:
    """``param``'s fp32 master in ``optimizer`` (a :class:`~swap_core.SwapOptimizer` or the optimizer it wraps), or
    ``None`` where it keeps none: the state's own tensor for an fp32 master, a new CPU tensor joined from the
    parameter for a master kept as its remainder. Synchronizes the optimizer first."""
    synchronize = getattr(optimizer, "synchronize", None)
    if callable(synchronize):
        synchronize()
    state = optimizer.state.get(param, {})
    master = state.get(MASTER_KEY)
    if isinstance(master, torch.Tensor):
        return master
    packed = state.get(REMAINDER_KEY)
    return joined_master(param, packed) if isinstance(packed, torch.Tensor) else None


def fp32_masters(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (``optimizer``'s, numbered as torch numbers it) with each master in remainder form as the fp32
    ``"master_param"``, in its place among the keys; states without one are the same objects."""
    saved = state_dict.get("state")
    if not isinstance(saved, Mapping) or not any(
        isinstance(entry, Mapping) and REMAINDER_KEY in entry for entry in saved.values()
    ):
        return state_dict
    params = {
        saved_id: param
        for group, saved_group in zip(optimizer.param_groups, state_dict["param_groups"], strict=True)
        for saved_id, param in zip(saved_group["params"], group["params"], strict=True)
    }
    state = {
        saved_id: with_fp32_master(params[saved_id], entry) if REMAINDER_KEY in entry else entry
        for saved_id, entry in saved.items()
    }
    return {**state_dict, "state": state}


def with_fp32_master(param: torch.Tensor, entry: Mapping[str, Any]) -> dict[str, Any]:
    """``param``'s state ``entry`` with a master in remainder form as the fp32 ``"master_param"`` (a new CPU
    tensor), in its place among the keys; every other value the same object."""
    return {
        (MASTER_KEY if key == REMAINDER_KEY else key): (joined_master(param, value) if key == REMAINDER_KEY else value)
        for key, value in entry.items()
    }
