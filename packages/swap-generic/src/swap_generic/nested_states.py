"""States kept as nested dicts (``state[p]["moments"] = {"exp_avg": ..., "exp_avg_sq": ...}``), swapped value by value.

swap-core swaps each tensor of such a dict (a *nest*: one level deep, string keys, tensors and numbers) in its place,
named by its path (``"moments.exp_avg"``, :data:`SEPARATOR`): ``optimizer.state`` keeps torch's layout between steps
and in the step, and checkpoints are the plain optimizer's. swap-generic tells a nest from other dicts
(:func:`is_nest`; :func:`nest_problem` says why another dict cannot be swapped, for its refusal), refuses a state whose
paths would clash with its own keys (:func:`nest_clash`), and compares states by their paths (:func:`flat_state`).
Which keys of a state are nests is learned from the optimizer's own steps (the wrap-time probe), never guessed from a
key's name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from swap_core.adapters import STATE_PATH_SEPARATOR

__all__ = ["SEPARATOR", "flat_state", "is_nest", "nest_clash", "nest_problem"]

SEPARATOR = STATE_PATH_SEPARATOR
"""Between a nest's key and its inner key in a path (``"moments.exp_avg"``), as swap-core names such states."""

_NUMBERS = (int, float, bool, complex)


def is_nest(value: object) -> bool:
    """Whether ``value`` is a dict kept key by key: not empty, string keys, each value a tensor or a number."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(inner, str) and isinstance(leaf, (torch.Tensor, *_NUMBERS)) for inner, leaf in value.items())
    )


def nest_problem(key: str, value: dict[Any, Any]) -> str:
    """What keeps the dict state ``key`` from being a nest, for a refusal: an empty dict, a key that is no string,
    or a value that is neither a tensor nor a number (a dict nested deeper, a list, an object)."""
    inner_keys = ", ".join(map(repr, value))
    where = f"it keeps state {key!r} as a dict ({inner_keys or 'empty'})"
    if not value:
        return f"{where}: an empty dict has no keys to keep in its place"
    for inner, leaf in value.items():
        if not isinstance(inner, str):
            return f"{where} with a key that is no string ({inner!r})"
        if isinstance(leaf, dict):
            return f"{where} nested deeper than one level: {key!r}[{inner!r}] is a dict ({', '.join(map(repr, leaf))})"
        if not isinstance(leaf, (torch.Tensor, *_NUMBERS)):
            return f"{where} holding a {type(leaf).__name__} under {inner!r}"
    raise ValueError(f"state {key!r} is a nest")


def flat_state(entry: Mapping[str, Any]) -> dict[str, Any]:
    """``entry`` with the values of each nest under their paths (``"moments.exp_avg"``), in the nest's place (a new
    dict: ``entry`` is not touched)."""
    flat: dict[str, Any] = {}
    for key, value in entry.items():
        if is_nest(value):
            for inner, leaf in value.items():
                flat[f"{key}{SEPARATOR}{inner}"] = leaf
        else:
            flat[key] = value
    return flat


def nest_clash(entry: Mapping[Any, Any]) -> str | None:
    """Why the paths of ``entry``'s nests could not be told from its own keys, or ``None``: a nest whose key holds the
    :data:`SEPARATOR`, or another key that reads as one of a nest's paths (``"moments.exp_avg"`` beside
    ``"moments"``)."""
    nests = {key for key, value in entry.items() if is_nest(value)}
    for key in entry:
        if not isinstance(key, str):
            continue
        if key in nests and SEPARATOR in key:
            return (
                f"it keeps state {key!r} as a dict of tensors, a key holding {SEPARATOR!r}, which swap-generic puts "
                "between a nested dict's key and its inner keys"
            )
        outer = key.partition(SEPARATOR)[0]
        if key not in nests and outer in nests:
            return f"it keeps state {key!r} beside the dict of tensors {outer!r}, whose inner keys it would read as"
    return None
