"""The param groups' hyperparameters as they were when a step began inside the backward (``step="in_backward"``).

The batches updated inside the backward read the groups as they were then. A change before ``step()`` (an LR
scheduler stepped before the optimizer, a step pre-hook that sets ``lr``) would reach only the batches left, so
``step()`` ends the step with the values it began with and then refuses the change, naming it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ...torch_compat import tensor_version

__all__ = ["GroupSnapshot"]


class GroupSnapshot:
    """Every param group's hyperparameters (all but ``params``) as they were when taken. A tensor (a tensor ``lr``)
    counts as changed when replaced or written in place (its version), so that no device value is read; a copy of
    it is kept for :meth:`in_place`."""

    def __init__(self, groups: Sequence[dict[str, Any]]) -> None:
        self._values = [{key: value for key, value in group.items() if key != "params"} for group in groups]
        self._versions = {
            id(value): (value, tensor_version(value), value.detach().clone())
            for values in self._values
            for value in values.values()
            if isinstance(value, torch.Tensor)
        }

    def changes(self, groups: Sequence[dict[str, Any]]) -> list[str]:
        """What differs in ``groups`` now, one line each, e.g. ``param_groups[0]['lr']: 0.01 -> 0.02``."""
        if len(groups) != len(self._values):
            return [f"len(param_groups): {len(self._values)} -> {len(groups)}"]
        changed = []
        for index, (before, group) in enumerate(zip(self._values, groups, strict=True)):
            for key in sorted((set(before) | set(group)) - {"params"}):
                old, new = before.get(key, _ABSENT), group.get(key, _ABSENT)
                if not self._same(old, new):
                    changed.append(f"param_groups[{index}][{key!r}]: {_shown(old)} -> {_shown(new)}")
        return changed

    def _same(self, old: Any, new: Any) -> bool:
        if isinstance(old, torch.Tensor):
            return new is old and tensor_version(new) == self._versions[id(old)][1]
        return not isinstance(new, torch.Tensor) and (old is new or bool(old == new))

    def _as_taken(self, value: Any) -> Any:
        """``value`` as it was when taken: a tensor written in place since, its copy."""
        if not isinstance(value, torch.Tensor):
            return value
        _, version, copy = self._versions[id(value)]
        return value if tensor_version(value) == version else copy

    def undo_since(self, groups: Sequence[dict[str, Any]], after: GroupSnapshot) -> None:
        """Take back what the updates wrote to ``groups`` between this snapshot and ``after`` (taken right after
        them): a value still as ``after`` has it but not as this one does goes back to this one's (a tensor written in
        place, from its copy); a value changed since ``after`` (the user's) stays. Nothing when the number of groups
        changed."""
        if not (len(groups) == len(self._values) == len(after._values)):
            return
        for before, updated, group in zip(self._values, after._values, groups, strict=True):
            for key in (set(before) | set(updated)) - {"params"}:
                old, new = before.get(key, _ABSENT), updated.get(key, _ABSENT)
                if not after._same(new, group.get(key, _ABSENT)):
                    continue  # changed since the updates: the user's
                if isinstance(old, torch.Tensor) and new is old:
                    if tensor_version(old) != self._versions[id(old)][1]:
                        with torch.no_grad():
                            old.copy_(self._versions[id(old)][2])
                elif old is _ABSENT:
                    group.pop(key, None)
                elif not self._same(old, new):
                    group[key] = self._as_taken(old)

    @contextlib.contextmanager
    def in_place(self, groups: Sequence[dict[str, Any]]) -> Iterator[None]:
        """The snapshot's values in ``groups`` for the block (where as many groups as it has), the values they had
        before it afterwards."""
        if len(groups) != len(self._values):
            yield
            return
        pairs = list(zip(self._values, groups, strict=True))
        saved = [{key: group[key] for key in values if key in group} for values, group in pairs]
        try:
            for values, group in pairs:
                group.update({key: self._as_taken(value) for key, value in values.items()})
            yield
        finally:
            for group, values in zip(groups, saved, strict=True):
                group.update(values)


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return f"tensor({value.item()!r})"
    return repr(value)
