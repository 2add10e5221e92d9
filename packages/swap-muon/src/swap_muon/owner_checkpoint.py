"""Distributed Muon's owner momentum in the standard per-shard checkpoint layout, and back.

Live, each matrix's full momentum sits on its owner rank only (host memory,
swapped like any state). A checkpoint must not depend on that plan: it holds
what ``torch.optim.Muon`` over the same DTensor parameters would hold, every
rank's ``momentum_buffer`` shard placed like its parameter. So

* :func:`scatter_owner_momentum` (``state_dict()``): each owner scatters the row
  blocks of its full momentum, and every rank wraps its block as a DTensor;
* :func:`gather_owner_momentum` (``load_state_dict()``): the ranks gather their
  loaded blocks to the owner of the new plan, which may differ from the saved
  one (another world size or layout: DCP has already resharded the blocks).

Collectives carry host tensors straight from and into host memory when the
shard group's backend has a CPU transport (gloo, or ``"cpu:gloo,cuda:nccl"``).
With a device-only backend (NCCL, HCCL) each parameter passes through transient
device buffers of one padded matrix, one parameter at a time, which is less
than a step holds (the step keeps a whole batch of momentum on the owner). Both
run on every rank of the shard group in the same order: ``state_dict()`` and
``load_state_dict()`` of a distributed Muon optimizer are collective calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from swap_core.adapters import local_tensor, shard_layout, wrap_local
from swap_core.errors import StateDictMismatchError
from swap_core.state_dict_loading import saved_param_ids

from .rows import as_bytes, chunk_rows, padded_rows
from .shard_group import ShardGroup

__all__ = ["MOMENTUM", "exchange_device", "gather_owner_momentum", "scatter_owner_momentum"]

MOMENTUM = "momentum_buffer"

_Kind = tuple[str, str] | None
"""What a rank loads for one parameter: ``("shard" | "full", dtype)``, ``("error", message)`` or nothing."""


def scatter_owner_momentum(
    state_dict: dict[str, Any], param_groups: Sequence[Mapping[str, Any]], owners: Sequence[int], shards: ShardGroup
) -> dict[str, Any]:
    """``state_dict`` with every owner's full momentum replaced by this rank's DTensor shard of it.

    ``owners[i]`` is the shard-group rank owning the ``i``-th parameter of ``param_groups``.
    """
    params, ids = _ids_by_param(state_dict, param_groups)
    state = state_dict["state"]
    # Each held momentum's dtype: the parameter's, or fp32 beside an fp32 master (master weights).
    held = {
        position: str(state[ids[id(param)]][MOMENTUM].dtype).removeprefix("torch.")
        for position, param in enumerate(params)
        if owners[position] == shards.rank and MOMENTUM in state.get(ids[id(param)], {})
    }
    everywhere = _union(held, shards)
    transport = exchange_device(shards)
    exported: dict[Any, Any] = {}
    for position, param in enumerate(params):
        saved_id = ids[id(param)]
        if saved_id not in state and position not in everywhere:
            continue
        entry = dict(state.get(saved_id, {}))
        if position in everywhere:
            full = entry[MOMENTUM] if owners[position] == shards.rank else None
            dtype = getattr(torch, everywhere[position])
            local = _scatter_rows(full, param, dtype, owners[position], shards, transport)
            entry[MOMENTUM] = wrap_local(local, shard_layout(param))
        exported[saved_id] = entry
    return {**state_dict, "state": exported}


def gather_owner_momentum(
    state_dict: Mapping[str, Any], param_groups: Sequence[Mapping[str, Any]], owners: Sequence[int], shards: ShardGroup
) -> dict[str, Any]:
    """``state_dict`` with each loaded momentum (shards, or whole tensors) whole on its owner and dropped elsewhere.

    Raises :class:`~swap_core.errors.StateDictMismatchError` on every rank of the shard group, before any
    data moves, if a momentum does not fit its parameter or the ranks loaded different entries.
    """
    params, ids = _ids_by_param(state_dict, param_groups)
    state = state_dict["state"]
    local_kinds = [_kind(state.get(ids[id(param)], {}).get(MOMENTUM), param, shards) for param in params]
    kinds = _agreed_kinds(local_kinds, params, ids, shards)
    transport = exchange_device(shards)
    imported: dict[Any, Any] = {}
    for position, param in enumerate(params):
        saved_id = ids[id(param)]
        if saved_id not in state:
            continue
        entry = dict(state[saved_id])
        kind = kinds[position]
        if kind is not None:
            value = entry.pop(MOMENTUM)
            if kind[0] == "shard":
                full = _gather_rows(local_tensor(value), param, owners[position], shards, transport)
            else:
                full = value
            if owners[position] == shards.rank:
                entry[MOMENTUM] = full
        imported[saved_id] = entry
    return {**state_dict, "state": imported}


# -- per-parameter collectives ----------------------------------------------------
def _scatter_rows(
    full: torch.Tensor | None,
    param: torch.Tensor,
    dtype: torch.dtype,
    owner: int,
    shards: ShardGroup,
    transport: torch.device | None,
) -> torch.Tensor:
    """This rank's rows of the owner's ``full`` momentum (of ``dtype``), in host memory."""
    rows = chunk_rows(param.shape[0], shards.size)
    width = max(rows)
    device = transport or local_tensor(param).device
    received = torch.empty((width, *param.shape[1:]), dtype=dtype, device=device)
    blocks = None
    if full is not None:
        if tuple(full.shape) != tuple(param.shape):
            raise StateDictMismatchError(
                f"Owner momentum of a {tuple(param.shape)} {param.dtype} parameter is {tuple(full.shape)} {full.dtype}"
            )
        padded = full if width * shards.size == full.shape[0] else padded_rows(full, width * shards.size)
        blocks = [as_bytes(block) for block in torch.split(padded.to(device), width)]
    dist.scatter(as_bytes(received), blocks, src=shards.global_rank(owner), group=shards.group)
    return received[: rows[shards.rank]].to("cpu")


def _gather_rows(
    local: torch.Tensor, param: torch.Tensor, owner: int, shards: ShardGroup, transport: torch.device | None
) -> torch.Tensor | None:
    """The whole matrix of every rank's ``local`` rows, in host memory on ``owner`` (``None`` elsewhere)."""
    rows = chunk_rows(param.shape[0], shards.size)
    width = max(rows)
    device = transport or local_tensor(param).device
    sent = local if local.shape[0] == width else padded_rows(local, width)
    received = None
    if owner == shards.rank:
        received = torch.empty((width * shards.size, *param.shape[1:]), dtype=local.dtype, device=device)
    blocks = list(torch.split(as_bytes(received), width)) if received is not None else None
    dist.gather(as_bytes(sent.to(device)), blocks, dst=shards.global_rank(owner), group=shards.group)
    return None if received is None else received[: param.shape[0]].to("cpu")


# -- agreement -------------------------------------------------------------------
def _kind(value: Any, param: torch.Tensor, shards: ShardGroup) -> _Kind:
    """How this rank's loaded momentum of ``param`` maps onto the plan (checked, never raising)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        return ("error", f"a {type(value).__name__}, not a tensor")
    layout = shard_layout(value)
    if layout is None:
        if tuple(value.shape) != tuple(param.shape):
            return ("error", f"shape {tuple(value.shape)}, the parameter is {tuple(param.shape)}")
        return ("full", str(value.dtype))
    expected = chunk_rows(param.shape[0], shards.size)[shards.rank]
    local_shape = tuple(local_tensor(value).shape)
    if tuple(layout.shape) != tuple(param.shape) or local_shape != (expected, *param.shape[1:]):
        return (
            "error",
            f"a shard {local_shape} of global shape {tuple(layout.shape)}; this rank's rows of the "
            f"{tuple(param.shape)} parameter are {(expected, *tuple(param.shape[1:]))}",
        )
    return ("shard", str(value.dtype))


def _agreed_kinds(
    local: list[_Kind], params: Sequence[torch.Tensor], ids: Mapping[int, object], shards: ShardGroup
) -> list[_Kind]:
    """Every rank's kinds, checked to be loadable and equal (else the same error on every rank)."""
    gathered: list[list[_Kind] | None] = [None] * shards.size
    dist.all_gather_object(gathered, local, group=shards.group)
    for position, param in enumerate(params):
        seen = [kinds[position] if kinds is not None else None for kinds in gathered]
        name = ids[id(param)]
        for rank, kind in enumerate(seen):
            if kind is not None and kind[0] == "error":
                raise StateDictMismatchError(
                    f"State {MOMENTUM!r} of parameter {name!r} on shard rank {rank} is {kind[1]}"
                )
        if any(kind != seen[0] for kind in seen):
            raise StateDictMismatchError(
                f"State {MOMENTUM!r} of parameter {name!r} differs between the ranks of the shard group "
                f"(per rank: {seen}): every rank must load the same checkpoint"
            )
    return list(local)


def _union(held: dict[int, str], shards: ShardGroup) -> dict[int, str]:
    """Every rank's ``held`` (position -> dtype name), merged: what the whole shard group holds."""
    gathered: list[dict[int, str] | None] = [None] * shards.size
    dist.all_gather_object(gathered, held, group=shards.group)
    return {position: dtype for entries in gathered if entries is not None for position, dtype in entries.items()}


def _ids_by_param(
    state_dict: Mapping[str, Any], param_groups: Sequence[Mapping[str, Any]]
) -> tuple[list[torch.Tensor], dict[int, object]]:
    """The parameters in order, and the state-dict id (int or FQN) of each, keyed by ``id(param)``."""
    if "state" not in state_dict or "param_groups" not in state_dict:
        raise StateDictMismatchError(
            f"Not an optimizer state dict: expected keys 'state' and 'param_groups', got {sorted(state_dict)}"
        )
    by_saved_id = saved_param_ids(param_groups, state_dict["param_groups"])
    params = [param for group in param_groups for param in group["params"]]
    return params, {id(param): saved_id for saved_id, param in by_saved_id.items()}


def exchange_device(shards: ShardGroup) -> torch.device | None:
    """The CPU when the shard group's backend moves host tensors; ``None``: each parameter's device."""
    config = dist.get_backend_config(shards.group)
    if any(part.split(":", 1)[0] == "cpu" for part in config.split(",")) or config == "gloo":
        return torch.device("cpu")
    return None
