"""Staging a loaded optimizer state dict into host memory, checked before anything changes."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .adapters.base import StateInit, StateSwapAdapter
from .dtensor import local_tensor, shard_layout
from .errors import StateDictMismatchError
from .master_weights.in_checkpoints import check_master_shape, loaded_remainder, master_from_param, remainder_value
from .master_weights.params import without_master
from .master_weights.policy import Masters
from .runtime.nested_entries import SEPARATOR
from .runtime.slots import SwapSlot, memory_stride
from .runtime.state_keys import MASTER_KEY, REMAINDER_KEY
from .runtime.store import StateSource, StateStore
from .runtime.tracked_state import TrackedState

__all__ = ["LoadedState", "load_swapped_state", "saved_param_ids"]


@dataclasses.dataclass
class LoadedState:
    """A checked state dict, staged: what :func:`load_swapped_state` returns for the caller to commit."""

    param_groups: list[dict[str, Any]]
    state: TrackedState
    swapped: list[tuple[SwapSlot, StateSource]]
    """Swapped states still to place: (slot, loaded value)."""
    masters_from_params: int = 0
    """bf16/fp16 parameters whose checkpoint had no master copy: theirs start as the live parameter."""
    low_precision_masters: int = 0
    """Masters the checkpoint held in a lower precision than fp32 (loaded as fp32, from their rounded values)."""
    params_to_set: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    """``(parameter, value)``: bf16 parameters whose loaded master is kept as its remainder, to set to the
    master's cast when the load commits (the remainder is over it)."""


def load_swapped_state(
    param_groups: Sequence[Mapping[str, Any]],
    adapter: StateSwapAdapter,
    store: StateStore,
    state_dict: Mapping[str, Any],
    *,
    masters: Masters,
) -> LoadedState:
    """New param groups and state for the optimizer of ``param_groups``, checked by its ``adapter``,
    and the swapped states still to place.

    ``store`` (a fresh one) decides which loaded states are swapped; their entries in the returned
    state are placeholders until the caller places the returned (slot, loaded value) pairs, in the
    live store's mirrors (:meth:`~swap_core.runtime.store.StateStore.load_in_place`) or in ``store``'s
    new host memory (:meth:`~swap_core.runtime.store.StateStore.add`). Nothing of the live optimizer
    is modified: the caller commits the result.

    ``masters``: with fp32 masters, a bf16/fp16 parameter's floating states load as fp32 (not cast to the
    parameter's dtype, as torch's load casts them) and its ``master_param`` with them; a state saved
    without one (a plain checkpoint) gets a master copied from the live parameter, counted in
    :attr:`LoadedState.masters_from_params`. Without masters, a checkpoint holding them is refused.
    """
    if "state" not in state_dict or "param_groups" not in state_dict:
        raise StateDictMismatchError(
            f"Not an optimizer state dict: expected keys 'state' and 'param_groups', got {sorted(state_dict)}"
        )
    groups = param_groups
    saved_groups = state_dict["param_groups"]
    id_map = _saved_id_map(groups, saved_groups)
    loaded = LoadedState([], TrackedState(), [])
    for saved_id, saved_state in state_dict["state"].items():
        if saved_id not in id_map:
            raise StateDictMismatchError(
                f"Loaded state dict has state for parameter id {saved_id!r}, which none of its param groups lists"
            )
        param, group, saved_group = id_map[saved_id]
        _stage_entry(loaded, adapter, store, saved_id, saved_state, param, group, saved_group, masters)
    loaded.param_groups = [_updated_group(group, saved) for group, saved in zip(groups, saved_groups, strict=True)]
    return loaded


def _stage_entry(
    loaded: LoadedState,
    adapter: StateSwapAdapter,
    store: StateStore,
    saved_id: object,
    saved_state: Mapping[str, Any],
    param: torch.Tensor,
    group: dict[str, Any],
    saved_group: Mapping[str, Any],
    masters: Masters,
) -> None:
    """Check the saved state of ``param`` against the adapter and stage it in ``loaded`` (swapped values placed
    later, see :func:`load_swapped_state`)."""
    _check_saved_master(loaded, masters, saved_id, saved_state, param)
    keeps_master = masters.keeps(param)
    # What the update runs on: the parameter, or the fp32 master of a bf16/fp16 one.
    updated = masters.as_updated(param)
    # The options the loaded group will have: the checkpoint's, the live group's where it has none.
    loaded_group = {**group, **saved_group, "params": group["params"]}
    if saved_state:
        problem = adapter.state_mismatch(updated, loaded_group, without_master(saved_state))
        if problem is not None:
            raise StateDictMismatchError(
                f"Loaded state dict: the state of parameter {saved_id!r} {problem}; nothing was loaded"
            )
    # An adapter whose update creates states knows no fresh state (nothing is held whole on one rank).
    expected = {} if adapter.lazy_states else adapter.initial_state(updated, group)
    entry = loaded.state[param]  # an empty saved entry stays an empty entry, as torch's load keeps it
    new = loaded.swapped
    as_remainder = masters.keeps_remainder(param)
    stage = functools.partial(
        _stage_value, store, new, param, updated.dtype, saved_group, nests=adapter.swaps_nested_states
    )
    for key, value in saved_state.items():
        if key == MASTER_KEY and as_remainder:
            packed, cast = loaded_remainder(param, value)
            entry[REMAINDER_KEY] = remainder_value(store, new, param, packed)
            loaded.params_to_set.append((param, cast))
            continue
        # Casting follows the *saved* group's options (fused, capturable), as torch's load does.
        entry[key] = stage(key, value, expected.get(key), saved_id)
    if keeps_master and saved_state and MASTER_KEY not in saved_state:
        # A plain checkpoint: the master starts as the live parameter (the checkpoint's own weights, loaded).
        key, entry_value = master_from_param(store, new, param, as_remainder=as_remainder)
        entry[key] = entry_value
        loaded.masters_from_params += 1


def _check_saved_master(
    loaded: LoadedState, masters: Masters, saved_id: object, saved_state: Mapping[str, Any], param: torch.Tensor
) -> None:
    """Refuse a saved master ``param`` keeps none for, one of another shape, or the in-memory remainder form; count
    a master saved in a lower precision."""
    keeps_master = masters.keeps(param)
    if MASTER_KEY in saved_state and not keeps_master:
        raise StateDictMismatchError(masters.unexpected_master(saved_id, param))
    if REMAINDER_KEY in saved_state:
        raise StateDictMismatchError(
            f"Loaded state dict: the state of parameter {saved_id!r} has {REMAINDER_KEY!r}, the form a SwapOptimizer "
            f"keeps a master in between steps, which checkpoints never hold (state_dict() saves it as the fp32 "
            f"{MASTER_KEY!r}); load a state dict made by state_dict(); nothing was loaded"
        )
    if keeps_master and MASTER_KEY in saved_state:
        check_master_shape(saved_id, param, saved_state[MASTER_KEY])
        loaded.low_precision_masters += saved_state[MASTER_KEY].dtype != torch.float32


def saved_param_ids(
    param_groups: Sequence[Mapping[str, Any]], saved_groups: Sequence[Mapping[str, Any]]
) -> dict[object, torch.Tensor]:
    """The live parameter behind each id of a state dict (an int from ``state_dict()``, an FQN from DCP).

    Ids pair with parameters by position in their groups, as ``Optimizer.load_state_dict`` pairs them;
    raises :class:`~swap_core.errors.StateDictMismatchError` if the group sizes differ.
    """
    return {saved_id: param for saved_id, (param, _, _) in _saved_id_map(param_groups, saved_groups).items()}


def _saved_id_map(
    groups: Sequence[Mapping[str, Any]], saved_groups: Sequence[Mapping[str, Any]]
) -> dict[object, tuple[torch.Tensor, Any, Mapping[str, Any]]]:
    _check_group_sizes(groups, saved_groups)
    id_map: dict[object, tuple[torch.Tensor, Any, Mapping[str, Any]]] = {}
    for group, saved in zip(groups, saved_groups, strict=True):
        for saved_id, param in zip(saved["params"], group["params"], strict=True):
            id_map[saved_id] = (param, group, saved)
    return id_map


def _check_group_sizes(groups: Sequence[Mapping[str, Any]], saved_groups: Sequence[Mapping[str, Any]]) -> None:
    if len(groups) != len(saved_groups):
        raise StateDictMismatchError(
            f"Loaded state dict has {len(saved_groups)} parameter groups, the optimizer has {len(groups)}"
        )
    for index, (group, saved) in enumerate(zip(groups, saved_groups, strict=True)):
        if len(group["params"]) != len(saved["params"]):
            raise StateDictMismatchError(
                f"Parameter group {index} of the loaded state dict has {len(saved['params'])} parameters, "
                f"the optimizer's has {len(group['params'])}"
            )


def _stage_value(
    store: StateStore,
    new: list[tuple[SwapSlot, StateSource]],
    param: torch.Tensor,
    dtype: torch.dtype,
    group: Mapping[str, Any],
    key: str,
    value: Any,
    expected: torch.Tensor | StateInit | None,
    saved_id: object,
    *,
    nests: bool = False,
) -> Any:
    """``dtype``: what a floating state of ``param`` is cast to (its own dtype, or fp32 beside a master). With
    ``nests`` (:attr:`~swap_core.adapters.StateSwapAdapter.swaps_nested_states`), each value of a dict is staged the
    same way in its place, by its path."""
    if isinstance(value, dict) and nests:
        return {
            inner: _stage_value(store, new, param, dtype, group, f"{key}{SEPARATOR}{inner}", leaf, None, saved_id)
            for inner, leaf in value.items()
        }
    if isinstance(value, dict):
        return {k: _cast_like_torch(param, dtype, v, k, group) for k, v in value.items()}
    if not isinstance(value, torch.Tensor):
        return value
    if key != "step" and param.is_floating_point():
        # A state the adapter holds whole on this rank (not sharded like its DTensor parameter), or any state
        # of a plain parameter: its own shape (Adafactor's row and column statistics are not the parameter's).
        whole = shard_layout(param) is None or (isinstance(expected, StateInit) and not expected.shard_like_param)
        template = StateInit(tuple(value.shape), dtype, shard_like_param=not whole)
        if store.should_swap(key, template):
            host_value = local_tensor(value).to(dtype=dtype)
            # The loaded tensor's memory order, as torch's load keeps it (a fused kernel reads memory in order).
            stride = memory_stride(host_value)
            if whole:
                slot = SwapSlot.whole(param, key, value.shape, dtype, stride)
            else:
                slot = SwapSlot.sharded_like(param, key, dtype, stride=stride)
            if host_value.shape != slot.shape:
                raise StateDictMismatchError(
                    f"State {key!r} of parameter {saved_id!r} has a local shard of shape {tuple(host_value.shape)}, "
                    f"but this rank's shard of the parameter has shape {tuple(slot.shape)}"
                )
            new.append((slot, host_value))
            return template
    cast = _cast_like_torch(param, dtype, value, key, group)
    if key == "step" or cast.dim() == 0:
        return cast
    return store.resident_copy(cast)


def _cast_like_torch(param: torch.Tensor, dtype: torch.dtype, value: Any, key: str, group: Mapping[str, Any]) -> Any:
    """``torch.optim.Optimizer.load_state_dict``'s casting rule for one state value, floating states to ``dtype``
    (the parameter's own, as torch casts them, or fp32 beside a master)."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        if group.get("capturable", False) or group.get("fused", False):
            return value.to(dtype=torch.float32, device=param.device)
        return value
    if param.is_floating_point():
        return value.to(dtype=dtype, device=param.device)
    return value.to(device=param.device)


def _updated_group(group: Mapping[str, Any], saved: Mapping[str, Any]) -> dict[str, Any]:
    updated = dict(saved)
    updated["params"] = group["params"]
    if "param_names" in group and "param_names" not in saved:
        updated["param_names"] = group["param_names"]
    return updated
