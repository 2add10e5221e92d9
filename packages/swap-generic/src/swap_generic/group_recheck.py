"""When the param groups are re-probed: a group option switched, or a group added or removed, since the last look.

The wrap-time probe steps twins of the optimizer with the param group values it has then. A coupling that a group
option switches on after wrapping (a group-norm clip enabled by ``group["clip_norm"] = 1.0``, or by a group added
with it) would run batch by batch unseen: silently wrong. So before each step the groups are compared with the ones
last probed, and the optimizer is probed again, before any batch, when they differ in kind:

- a group was added or removed, or a group gained or lost a key;
- a value changed its type, or its truth (``None``, ``0``, ``False`` and the empty switch nothing on; any other value
  may), or, not being a number, its value (a string mode, an object);
- the same, element by element, inside tuples and lists.

A number that changes within its type and its truth (a learning rate an LR scheduler sets, ``betas`` a cycle
moves), and a tensor that keeps its dtype and shape, are schedules, not switches: not re-probed. What the step
itself writes into its groups (schedule-free's ``k``) was probed with the step and is taken as it is after each
step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swap_core.adapters import same_value

__all__ = ["GroupSnapshot", "group_switch", "snapshot"]

GroupSnapshot = list[dict[str, Any]]
"""Each param group's values but its ``"params"``, as last probed or stepped."""


def snapshot(groups: Sequence[dict[str, Any]]) -> GroupSnapshot:
    """The values of ``groups`` now (the objects themselves: values are replaced, not edited in place)."""
    return [{key: value for key, value in group.items() if key != "params"} for group in groups]


def group_switch(before: GroupSnapshot, groups: Sequence[dict[str, Any]]) -> str | None:
    """What in ``groups`` differs in kind from ``before`` (see the module's docstring), said for an error message;
    ``None`` when nothing does."""
    for index, group in enumerate(groups):
        if index >= len(before):
            options = {key: value for key, value in group.items() if key != "params"}
            return f"param group {index} was added (with {options!r})"
        known = before[index]
        if len(group) != len(known) + 1:
            keys = sorted(set(group).difference(known, ("params",)) | set(known).difference(group), key=str)
            return f"param group {index} gained or lost {', '.join(map(repr, keys))}"
        for key, value in group.items():
            if key != "params" and not _same_kind(known.get(key), value):
                return f"param group {index}'s {key!r} changed from {known.get(key)!r} to {value!r}"
    if len(groups) < len(before):
        return f"param group {len(groups)} was removed"
    return None


def _same_kind(first: object, second: object) -> bool:
    if first is second:
        return True
    if type(first) is not type(second):
        return False
    if isinstance(first, (int, float, complex)):  # bool too: its truth is its value
        return bool(first) == bool(second)
    if isinstance(first, torch.Tensor):
        assert isinstance(second, torch.Tensor)
        return first.dtype == second.dtype and first.shape == second.shape
    if isinstance(first, (tuple, list)):
        assert isinstance(second, (tuple, list))
        return len(first) == len(second) and all(map(_same_kind, first, second))
    return same_value(first, second)
