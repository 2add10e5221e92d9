"""Optimizers that delegate their step to inner optimizers, found before anything is stepped.

swap-generic runs an optimizer's own step once per batch with its param groups narrowed to the batch, and moves the
states in its own ``state``. An optimizer whose step steps other optimizers (a list of them, one per parameter
subset; a wrapper such as a lookahead over a base optimizer) gets none of that right: the inner optimizers' groups
are not narrowed, so every batch steps every inner parameter, and their states are not moved. The wrap-time probe
must not step it either, nor let its twins step the real inner optimizers. :func:`inner_optimizer` finds one,
reachable from the optimizer's attributes: through containers (dicts, lists, tuples, sets), objects' attributes,
bound methods (``inner.step`` kept as an attribute) and the cells of closures.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["InnerOptimizer", "inner_optimizer"]

_MAX_DEPTH = 8
"""How deep the search follows references from an attribute (a composite rarely nests deeper than two or three)."""

_MAX_VISITS = 100_000
"""How many objects the search visits at most (a reference to a large structure is not walked whole)."""

_NOT_WALKED = (torch.Tensor, torch.nn.Module, type, types.ModuleType, str, bytes, int, float, complex, bool)
"""Values whose insides hold no optimizer of the user's (a model is a model: its parameters are not optimizers)."""


@dataclasses.dataclass(frozen=True)
class InnerOptimizer:
    """An optimizer reachable from another optimizer's attributes."""

    path: str
    """Where it was reached, as Python would spell it from the optimizer (``Composite.inner[0]``)."""
    optimizer: torch.optim.Optimizer


def inner_optimizer(optimizer: torch.optim.Optimizer) -> InnerOptimizer | None:
    """The first optimizer other than ``optimizer`` reachable from its attributes (``param_groups`` and ``state``
    aside), or ``None``."""
    seen = {id(optimizer)}
    pending: deque[tuple[str, Any, int]] = deque(
        (f"{type(optimizer).__name__}.{name}", value, 0)
        for name, value in vars(optimizer).items()
        if name not in ("param_groups", "state")
    )
    while pending and len(seen) < _MAX_VISITS:
        path, value, depth = pending.popleft()
        if id(value) in seen or isinstance(value, _NOT_WALKED) or value is None:
            continue
        seen.add(id(value))
        if isinstance(value, torch.optim.Optimizer):
            return InnerOptimizer(path, value)
        if depth < _MAX_DEPTH:
            pending.extend((inner_path, inner, depth + 1) for inner_path, inner in _references(path, value))
    return None


def _references(path: str, value: Any) -> Iterator[tuple[str, Any]]:
    """What ``value`` refers to, each with its path."""
    if isinstance(value, Mapping):
        yield from ((f"{path}[{key!r}]", item) for key, item in value.items())
    elif isinstance(value, (list, tuple, set, frozenset)):
        yield from ((f"{path}[{index}]", item) for index, item in enumerate(value))
    elif isinstance(value, types.MethodType):
        yield f"{path}.__self__", value.__self__
    elif isinstance(value, types.FunctionType):
        yield from _closure(path, value)
    elif isinstance(value, functools.partial):
        yield from ((f"{path}.func", value.func), (f"{path}.args", value.args), (f"{path}.keywords", value.keywords))
    elif hasattr(value, "__dict__"):
        yield from ((f"{path}.{name}", item) for name, item in vars(value).items())


def _closure(path: str, function: types.FunctionType) -> Iterator[tuple[str, Any]]:
    """The values a function's closure holds (a function kept as an attribute that steps inner optimizers)."""
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=True):
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell: a variable not bound yet
            continue
        yield f"{path} (its closure's {name!r})", contents
