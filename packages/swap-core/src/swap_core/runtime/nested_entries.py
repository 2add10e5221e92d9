"""Swapped states kept in a dict nested one level deep in a parameter's state (``state[p]["moments"]["exp_avg"]``).

An adapter that swaps such states (:attr:`~swap_core.adapters.StateSwapAdapter.swaps_nested_states`: swap-generic,
for an optimizer that keeps its moments in a dict) names each by its path, ``"moments.exp_avg"``: the key of its
slot, the name ``SwapConfig(state_keys=...)`` takes and the stats and layouts show. In ``optimizer.state`` the value
stays where the optimizer keeps it, inside the nested dict, as torch's layout has it: :func:`located` finds the dict
and the key a slot's value lives under, :func:`flat_items` lists a state's values by their paths.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["SEPARATOR", "flat_items", "located", "value_at"]

SEPARATOR = "."
"""Between a nested dict's key and its inner key in a path (``"moments.exp_avg"``)."""


def located(entry: Mapping[str, Any], key: str) -> tuple[Any, str]:
    """The dict the value of ``key`` lives in and its key there: ``entry`` itself (a key of its own, the usual case:
    one lookup), or the nested dict a path names."""
    if key in entry:
        return entry, key
    outer, separator, inner = key.partition(SEPARATOR)
    if separator:
        nest = entry.get(outer)
        if isinstance(nest, dict):
            return nest, inner
    return entry, key


def value_at(entry: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """The value of ``key`` (a path into a nested dict, or a key of its own) in ``entry``, or ``default``."""
    container, leaf = located(entry, key)
    return container.get(leaf, default)


def flat_items(entry: Mapping[str, Any], *, nested: bool) -> Iterator[tuple[str, Any]]:
    """Each value of ``entry`` with its key; with ``nested``, each value of a dict nested in it under its path
    instead of the dict."""
    for key, value in entry.items():
        if nested and isinstance(value, dict):
            for inner, leaf in value.items():
                yield f"{key}{SEPARATOR}{inner}", leaf
        else:
            yield key, value
