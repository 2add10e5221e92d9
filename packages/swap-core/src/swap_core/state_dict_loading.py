"""Staging a loaded optimizer state dict into host memory, checked before anything changes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .adapters.base import StateInit, StateSwapAdapter
from .errors import StateDictMismatchError
from .runtime.dtensor import local_tensor, shard_layout
from .runtime.slots import SwapSlot, layout_stride
from .runtime.store import StateSource, StateStore
from .runtime.tracked_state import TrackedState

__all__ = ["load_swapped_state", "saved_param_ids"]


def load_swapped_state(
    param_groups: Sequence[Mapping[str, Any]],
    adapter: StateSwapAdapter,
    store: StateStore,
    state_dict: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], TrackedState, list[tuple[SwapSlot, StateSource]]]:
    """New param groups and state for the optimizer of ``param_groups``, checked by its ``adapter``,
    and the swapped states still to place.

    ``store`` (a fresh one) decides which loaded states are swapped; their entries in the returned
    state are placeholders until the caller places the returned (slot, loaded value) pairs, in the
    live store's mirrors (:meth:`~swap_core.runtime.store.StateStore.load_in_place`) or in ``store``'s
    new host memory (:meth:`~swap_core.runtime.store.StateStore.add`). Nothing of the live optimizer
    is modified: the caller commits the result.
    """
    if "state" not in state_dict or "param_groups" not in state_dict:
        raise StateDictMismatchError(
            f"Not an optimizer state dict: expected keys 'state' and 'param_groups', got {sorted(state_dict)}"
        )
    groups = param_groups
    saved_groups = state_dict["param_groups"]
    id_map = _saved_id_map(groups, saved_groups)
    staged = TrackedState()
    new: list[tuple[SwapSlot, StateSource]] = []
    for saved_id, saved_state in state_dict["state"].items():
        if saved_id not in id_map:
            raise StateDictMismatchError(
                f"Loaded state dict has state for parameter id {saved_id!r}, which none of its param groups lists"
            )
        param, group, saved_group = id_map[saved_id]
        # The options the loaded group will have: the checkpoint's, the live group's where it has none.
        loaded_group = {**group, **saved_group, "params": group["params"]}
        if saved_state:
            problem = adapter.state_mismatch(param, loaded_group, saved_state)
            if problem is not None:
                raise StateDictMismatchError(
                    f"Loaded state dict: the state of parameter {saved_id!r} {problem}; nothing was loaded"
                )
        # An adapter whose update creates states knows no fresh state (nothing is held whole on one rank).
        expected = {} if adapter.lazy_states else adapter.initial_state(param, group)
        entry = staged[param]  # an empty saved entry stays an empty entry, as torch's load keeps it
        for key, value in saved_state.items():
            # Casting follows the *saved* group's options (fused, capturable), as torch's load does.
            entry[key] = _stage_value(store, new, param, saved_group, key, value, expected.get(key), saved_id)
    new_groups = [_updated_group(group, saved) for group, saved in zip(groups, saved_groups, strict=True)]
    return new_groups, staged, new


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
    group: Mapping[str, Any],
    key: str,
    value: Any,
    expected: torch.Tensor | StateInit | None,
    saved_id: object,
) -> Any:
    if isinstance(value, dict):
        return {k: _cast_like_torch(param, v, k, group) for k, v in value.items()}
    if not isinstance(value, torch.Tensor):
        return value
    if key != "step" and param.is_floating_point():
        # A state the adapter holds whole on this rank (not sharded like its DTensor parameter), or any state
        # of a plain parameter: its own shape (Adafactor's row and column statistics are not the parameter's).
        whole = shard_layout(param) is None or (isinstance(expected, StateInit) and not expected.shard_like_param)
        template = StateInit(tuple(value.shape), param.dtype, shard_like_param=not whole)
        if store.should_swap(key, template):
            host_value = local_tensor(value).to(dtype=param.dtype)
            # The loaded tensor's memory order, as torch's load keeps it (a fused kernel reads memory in order).
            stride = layout_stride(host_value)
            if whole:
                slot = SwapSlot(param, key, torch.Size(value.shape), param.dtype, stride=stride)
            else:
                slot = SwapSlot(param, key, local_tensor(param).shape, param.dtype, shard_layout(param), stride)
            if host_value.shape != slot.shape:
                raise StateDictMismatchError(
                    f"State {key!r} of parameter {saved_id!r} has a local shard of shape {tuple(host_value.shape)}, "
                    f"but this rank's shard of the parameter has shape {tuple(slot.shape)}"
                )
            new.append((slot, host_value))
            return template
    cast = _cast_like_torch(param, value, key, group)
    if key == "step" or cast.dim() == 0:
        return cast
    return store.resident_copy(cast)


def _cast_like_torch(param: torch.Tensor, value: Any, key: str, group: Mapping[str, Any]) -> Any:
    """``torch.optim.Optimizer.load_state_dict``'s casting rule for one state value."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        if group.get("capturable", False) or group.get("fused", False):
            return value.to(dtype=torch.float32, device=param.device)
        return value
    if param.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)


def _updated_group(group: Mapping[str, Any], saved: Mapping[str, Any]) -> dict[str, Any]:
    updated = dict(saved)
    updated["params"] = group["params"]
    if "param_names" in group and "param_names" not in saved:
        updated["param_names"] = group["param_names"]
    return updated
