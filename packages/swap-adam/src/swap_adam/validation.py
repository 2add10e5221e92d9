"""What the Adam adapter refuses, and why, before it touches any state.

Swapping replaces ``Adam.step`` with per-batch calls of ``torch.optim.adam.adam``,
so it is exact only when the optimizer's step *is* torch's Adam step and its
state holds only the keys that step knows. Everything here runs at wrap time
(or when a param group added later gets its first state), raises
:class:`~swap_core.errors.UnsupportedOptimizerError`, and modifies nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from swap_core.errors import UnsupportedOptimizerError

__all__ = [
    "ADAM_STATE_KEYS",
    "check_group",
    "check_optimizer",
    "check_state_keys",
    "check_step_implementation",
]

ADAM_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
"""Every state key ``torch.optim.Adam`` / ``AdamW`` create."""

_UNSUPPORTED_OPTIONS = ("differentiable",)
"""Group options swapping cannot honour: autograd through optimizer state cannot survive host round trips."""

_FAMILY_METHODS = ("step", "_init_group")
"""Methods whose behaviour the adapter reproduces; a subclass overriding one would be silently bypassed."""


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Everything that must hold before ``optimizer`` is wrapped; raises without modifying it."""
    check_step_implementation(type(optimizer))
    for index, group in enumerate(optimizer.param_groups):
        check_group(group, index, type(optimizer))
    check_state_keys(optimizer)


def check_step_implementation(optimizer_cls: type[torch.optim.Optimizer]) -> None:
    """The class must use torch's own Adam ``step`` and ``_init_group``, which the adapter reproduces."""
    for name in _FAMILY_METHODS:
        owner = _defining_class(optimizer_cls, name)
        if owner is None or _unwrapped(owner.__dict__[name]) in _torch_implementations(name):
            continue
        raise UnsupportedOptimizerError(
            f"{_qualname(optimizer_cls)} overrides {name} (in {_qualname(owner)}), which swap-adam's AdamAdapter "
            f"would bypass: swapping runs torch.optim.adam.adam on each batch instead of calling {name}. Register an "
            f"adapter that implements this optimizer's update: "
            f"swap_core.register_adapter({optimizer_cls.__name__}, factory, name=...)"
        )


def check_group(group: Mapping[str, Any], index: int | None, optimizer_cls: type[torch.optim.Optimizer]) -> None:
    """Options of one param group that swapping cannot support."""
    where = f"param group {index}" if index is not None else "a param group"
    for option in _UNSUPPORTED_OPTIONS:
        if group.get(option, False):
            raise UnsupportedOptimizerError(
                f"{optimizer_cls.__name__} with {option}=True in {where} cannot be swapped: its state is copied "
                f"between host and device memory, which breaks the autograd graph {option} needs; "
                f"create the optimizer with {option}=False"
            )


def check_state_keys(optimizer: torch.optim.Optimizer) -> None:
    """Existing state may hold only Adam's keys: an unknown one belongs to math the adapter does not run."""
    unknown = sorted({str(key) for state in optimizer.state.values() for key in state if key not in ADAM_STATE_KEYS})
    if unknown:
        optimizer_cls = type(optimizer)
        raise UnsupportedOptimizerError(
            f"{_qualname(optimizer_cls)} has state keys {unknown} that torch.optim.Adam does not create "
            f"(Adam's are {sorted(ADAM_STATE_KEYS)}); swap-adam's AdamAdapter would ignore them. Register an "
            f"adapter that knows them: swap_core.register_adapter({optimizer_cls.__name__}, factory, name=...)"
        )


def _defining_class(cls: type, name: str) -> type | None:
    return next((klass for klass in cls.__mro__ if name in klass.__dict__), None)


def _torch_implementations(name: str) -> set[Callable[..., Any]]:
    """torch's own functions for ``name``; AdamW is listed too for torch releases where it is not an Adam."""
    families = (torch.optim.Adam, torch.optim.AdamW)
    return {_unwrapped(owner.__dict__[name]) for owner in (_defining_class(cls, name) for cls in families) if owner}


def _unwrapped(function: Callable[..., Any]) -> Callable[..., Any]:
    """Past torch's decorators (``_use_grad_for_differentiable``, profiling hooks), to the defining function."""
    unwrapped: Callable[..., Any] = inspect.unwrap(function)
    return unwrapped


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
