"""Optimizers that delegate their step to inner optimizers, found before anything is stepped.

swap-generic runs an optimizer's own step once per batch with its param groups narrowed to the batch, and moves the
states in its own ``state``. An optimizer whose step steps other optimizers (a list of them, one per parameter
subset; a wrapper such as a lookahead over a base optimizer) gets none of that right: the inner optimizers' groups
are not narrowed, so every batch steps every inner parameter, and their states are not moved. The wrap-time probe
must not step it either, nor let its twins step the real inner optimizers. :func:`inner_optimizer` finds one,
reachable from the optimizer's attributes: through containers (dicts, lists, tuples, sets), objects' attributes,
bound methods (``inner.step`` kept as an attribute) and the cells of closures.

The same search finds the optimizer's own parameters held outside its param groups (:func:`held_parameter`): a dict
keyed by them, or holding them, that pairs parameters (LoRA's A with its B) by identity. The probe's stand-ins cannot
take their place there, so a step that reads a partner through it looks per-parameter to the probe; run batch by
batch, or inside the backward as each batch's gradients become final, it reads the partner out of torch's order.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from swap_core.adapters.base import StateSwapAdapter

__all__ = [
    "HeldParameter",
    "InnerOptimizer",
    "held_parameter",
    "inner_optimizer",
    "reachable_generators",
    "swap_machinery",
]

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


@dataclasses.dataclass(frozen=True)
class HeldParameter:
    """One of an optimizer's parameters reachable from its attributes."""

    path: str
    """Where it was reached (``LoraPairs.partner[<parameter of shape (8, 16)>]``)."""
    group_index: int
    position: int
    """Its place in that param group's ``"params"``."""
    shape: tuple[int, ...]


def inner_optimizer(optimizer: torch.optim.Optimizer) -> InnerOptimizer | None:
    """The first optimizer other than ``optimizer`` reachable from its attributes (``param_groups`` and ``state``
    aside), or ``None``."""
    found = _first_reachable(optimizer, lambda value: isinstance(value, torch.optim.Optimizer))
    if found is None:
        return None
    path, inner = found
    return InnerOptimizer(path, inner)


def held_parameter(optimizer: torch.optim.Optimizer) -> HeldParameter | None:
    """The first of ``optimizer``'s parameters reachable from its attributes (``param_groups`` and ``state`` aside),
    or ``None``."""
    places = {
        id(param): (group_index, position)
        for group_index, group in enumerate(optimizer.param_groups)
        for position, param in enumerate(group["params"])
    }
    found = _first_reachable(optimizer, lambda value: id(value) in places)
    if found is None:
        return None
    path, param = found
    return HeldParameter(path, *places[id(param)], tuple(param.shape))


def reachable_generators(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Generator]]:
    """Every ``torch.Generator`` reachable from ``optimizer``'s attributes (``param_groups`` and ``state`` aside),
    with its path: a generator of its own that its step may draw from."""
    return [(path, value) for path, value in _reachable(optimizer) if isinstance(value, torch.Generator)]


def _first_reachable(optimizer: torch.optim.Optimizer, wanted: Callable[[Any], bool]) -> tuple[str, Any] | None:
    """The first value other than ``optimizer`` reachable from its attributes (``param_groups`` and ``state`` aside)
    that is ``wanted``, with its path, breadth first; or ``None``."""
    return next(((path, value) for path, value in _reachable(optimizer) if wanted(value)), None)


def _reachable(optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, Any]]:
    """The values other than ``optimizer`` reachable from its attributes (``param_groups`` and ``state`` aside), each
    with its path, breadth first (swap's own machinery skipped)."""
    seen = {id(optimizer)}
    pending: deque[tuple[str, Any, int]] = deque(
        (f"{type(optimizer).__name__}.{name}", value, 0)
        for name, value in vars(optimizer).items()
        if name not in ("param_groups", "state")
    )
    while pending and len(seen) < _MAX_VISITS:
        path, value, depth = pending.popleft()
        if id(value) in seen or value is None:
            continue
        seen.add(id(value))
        if swap_machinery(value):  # a wrapped optimizer's hooks and redirects: swap's, not the optimizer's
            continue
        yield path, value
        if depth < _MAX_DEPTH and not isinstance(value, _NOT_WALKED):
            pending.extend((inner_path, inner, depth + 1) for inner_path, inner in _references(path, value))


def _references(path: str, value: Any) -> Iterator[tuple[str, Any]]:
    """What ``value`` refers to, each with its path."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield f"{path}[{_key(key)}] (a key)", key
            yield f"{path}[{_key(key)}]", item
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


def swap_machinery(value: object) -> bool:
    """Whether ``value`` is swap's own: a hook or a method redirect that a ``SwapOptimizer`` installs on the optimizer
    it wraps (they hold the adapter, which holds the parameters), or an adapter. The searches skip them and the
    probe's twins share them (a twin runs no hook)."""
    if isinstance(value, functools.partial):
        value = value.func
    if isinstance(value, types.MethodType):
        value = value.__self__
    if isinstance(value, StateSwapAdapter):
        return True
    module = value.__module__ if isinstance(value, types.FunctionType) else type(value).__module__
    return module.split(".")[0] == "swap_core"


def _key(key: object) -> str:
    """A dict key as a path spells it (a tensor by its shape, not its values)."""
    if isinstance(key, torch.Tensor):
        kind = "parameter" if isinstance(key, torch.nn.Parameter) else "tensor"
        return f"<{kind} of shape {tuple(key.shape)}>"
    return repr(key)


def _closure(path: str, function: types.FunctionType) -> Iterator[tuple[str, Any]]:
    """The values a function's closure holds (a function kept as an attribute that steps inner optimizers)."""
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=True):
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell: a variable not bound yet
            continue
        yield f"{path} (its closure's {name!r})", contents
