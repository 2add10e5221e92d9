"""States kept as nested dicts (``state[p]["moments"] = {"exp_avg": ..., "exp_avg_sq": ...}``), swapped key by key.

swap-core swaps the tensors a parameter's state holds as its own keys. swap-generic therefore keeps each entry of
a *nest* (a dict in a state, one level deep, whose values are tensors and numbers) as a key of its own, named by its
path: ``"moments.exp_avg"``, in the nest's place and in its order. That flat form is what ``optimizer.state`` holds
between steps and what swap-core sees; the optimizer's own step runs over the nested form
(:func:`nested_for_the_step`), and checkpoints hold it (:func:`nested_state_dict`, :func:`flat_state_dict`), exactly
as the plain optimizer's ``state_dict()`` does. Which keys of a state are nests is learned from the optimizer's own
steps (the wrap-time probe), never guessed from a key's name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "SEPARATOR",
    "flat_state",
    "flat_state_dict",
    "flatten_in_place",
    "is_nest",
    "nest_clash",
    "nest_problem",
    "nested_for_the_step",
    "nested_state",
    "nested_state_dict",
]

SEPARATOR = "."
"""Between a nest's key and its inner key in the flat form (``"moments.exp_avg"``)."""

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
    """``entry`` with the values of each nest as keys of their own (``"moments.exp_avg"``), in the nest's place."""
    flat: dict[str, Any] = {}
    for key, value in entry.items():
        if is_nest(value):
            for inner, leaf in value.items():
                flat[f"{key}{SEPARATOR}{inner}"] = leaf
        else:
            flat[key] = value
    return flat


def nested_state(entry: Mapping[str, Any], nests: frozenset[str]) -> dict[str, Any]:
    """The inverse of :func:`flat_state` for the nests named ``nests``: their keys gathered back into a dict each,
    where the first of them is."""
    nested: dict[str, Any] = {}
    for key, value in entry.items():
        outer, separator, inner = key.partition(SEPARATOR)
        if separator and outer in nests:
            nested.setdefault(outer, {})[inner] = value
        else:
            nested[key] = value
    return nested


def flatten_in_place(entries: Iterable[dict[str, Any]]) -> set[str]:
    """Each of ``entries`` (the same dict objects: swap-core holds them) in its flat form; the nests found."""
    found: set[str] = set()
    for entry in entries:
        nests = [key for key, value in entry.items() if is_nest(value)]
        if nests:
            found.update(nests)
            _refill(entry, flat_state(entry))
    return found


@contextlib.contextmanager
def nested_for_the_step(states: Iterable[dict[str, Any]], nests: frozenset[str]) -> Iterator[set[str]]:
    """Each of ``states`` in its nested form while the block runs (the optimizer's own step), flat again after it,
    whatever happens; gives the nests found after the block (a nest the step made), once it ended."""
    entries = list(states)
    for entry in entries:
        _refill(entry, nested_state(entry, nests))
    found: set[str] = set()
    try:
        yield found
    finally:
        found.update(flatten_in_place(entries))


def nested_state_dict(state_dict: Mapping[str, Any], nests: frozenset[str]) -> dict[str, Any]:
    """``state_dict`` with each state in its nested form (new dicts: the live entries are not touched)."""
    state = {saved_id: nested_state(entry, nests) for saved_id, entry in state_dict["state"].items()}
    return {**state_dict, "state": state}


def flat_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each state in its flat form (new dicts: the loaded ones are not touched)."""
    state = {saved_id: flat_state(entry) for saved_id, entry in state_dict["state"].items()}
    return {**state_dict, "state": state}


def _refill(entry: dict[str, Any], contents: dict[str, Any]) -> None:
    """``entry`` holds ``contents``, in their order (the same dict object)."""
    entry.clear()
    entry.update(contents)


def nest_clash(entry: Mapping[Any, Any]) -> str | None:
    """Why the flat form of ``entry`` could not be told from its nests, or ``None``: a nest whose key holds the
    :data:`SEPARATOR`, or another key that reads as one of a nest's (``"moments.exp_avg"`` beside ``"moments"``)."""
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
