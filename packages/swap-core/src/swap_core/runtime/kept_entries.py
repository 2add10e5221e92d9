"""The resident values of entries of ``optimizer.state``, kept right before an update writes them, to put back.

An update writes its batch's resident states (small ones, step counters) in place, and an adapter may write an entry
outside its batch too (:meth:`~swap_core.adapters.StateSwapAdapter.entries_written_beside`: swap-generic's group step
counter kept in the group's first parameter's state). Undoing such a step (a take-back of the step begun inside the
backward, a failed step's journal) puts those values back. Swapped keys are the store's: their host mirrors are put
back another way, and are neither kept nor removed here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .nested_entries import SEPARATOR

__all__ = ["KeptEntries"]


class KeptEntries:
    """Entries of ``state`` with their resident values as they were when kept; :meth:`put_back` puts them back, the
    last kept first (an entry kept twice in one step ends as it was at its first keep)."""

    def __init__(self) -> None:
        self._kept: list[tuple[dict[str, Any], dict[str, Any], frozenset[str]]] = []

    def __bool__(self) -> bool:
        return bool(self._kept)

    def keep(self, entries: Iterable[tuple[dict[str, Any], frozenset[str]]]) -> None:
        """The resident values of each ``(state entry, its swapped keys)``, as they are now (tensors cloned where
        they live)."""
        for entry, swapped in entries:
            self._kept.append((entry, _resident_values(entry, swapped), swapped))

    def put_back(self) -> None:
        """Every kept entry's resident values back, the last kept first; then forget them."""
        for entry, values, swapped in reversed(self._kept):
            _put_back(entry, values, swapped)
        self._kept = []

    def clear(self) -> None:
        self._kept = []


class _KeptNest(dict[str, Any]):
    """The resident values of a dict nested in an entry, as kept (put back into that dict, key by key)."""


def _resident_values(entry: Mapping[str, Any], swapped: frozenset[str], prefix: str = "") -> dict[str, Any]:
    """The values of ``entry`` that are not swapped, as they are now (tensors cloned where they live; a dict nested
    in it kept the same way, its keys' paths under ``prefix``)."""
    kept: dict[str, Any] = {}
    for key, value in entry.items():
        path = prefix + key
        if path in swapped:
            continue
        if isinstance(value, torch.Tensor):
            kept[key] = value.detach().clone()
        elif isinstance(value, dict) and not prefix:
            kept[key] = _KeptNest(_resident_values(value, swapped, f"{path}{SEPARATOR}"))
        else:
            kept[key] = value
    return kept


def _put_back(entry: dict[str, Any], values: Mapping[str, Any], swapped: frozenset[str], prefix: str = "") -> None:
    """``entry``'s resident values as kept: written back in place where the tensor is the same shape and dtype, set
    otherwise; keys the update added are removed (a swapped key is the store's)."""
    for key in [key for key in entry if key not in values and prefix + key not in swapped]:
        del entry[key]
    for key, value in values.items():
        current = entry.get(key)
        if isinstance(value, _KeptNest):
            entry[key] = nest = current if isinstance(current, dict) else {}
            _put_back(nest, value, swapped, f"{prefix}{key}{SEPARATOR}")
        elif (
            isinstance(value, torch.Tensor)
            and isinstance(current, torch.Tensor)
            and current.shape == value.shape
            and current.dtype == value.dtype
        ):
            with torch.no_grad():
                current.copy_(value)
        else:
            entry[key] = value
