"""Refusing optimizers whose own code a swap would silently bypass.

An adapter that reproduces a torch family's math (Adam, RMSprop, Muon) calls torch's functional
kernel on each batch instead of ``optimizer.step()``. A subclass that overrides ``step`` (to clip or
edit gradients first) or ``_init_group``, or an instance whose ``step`` was replaced
(``opt.step = patched``), would then never run its code: the result would differ from the plain
optimizer's. Both are refused at wrap time, before any state moves, with the fix in the message.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import UnsupportedOptimizerError
from ..torch_compat import is_lr_scheduler_step_wrapper

__all__ = ["check_instance_step", "check_no_bypassed_overrides"]


def check_no_bypassed_overrides(
    optimizer: torch.optim.Optimizer,
    families: Sequence[type[torch.optim.Optimizer]],
    methods: Sequence[str],
    adapter_name: str,
) -> None:
    """``optimizer``'s class must run the ``methods`` of one of ``families`` (torch's), which the adapter reproduces."""
    optimizer_cls = type(optimizer)
    for name in methods:
        owner = _defining_class(optimizer_cls, name)
        if owner is None or _unwrapped(owner.__dict__[name]) in _implementations(families, name):
            continue
        raise UnsupportedOptimizerError(
            f"{_qualname(optimizer_cls)} overrides {name} (in {_qualname(owner)}), which {adapter_name} would bypass: "
            f"swapping runs torch's functional kernel on each batch instead of calling {name}. Move the extra work "
            f"out of {name} (e.g. edit the gradients before calling step()), or register an adapter that implements "
            f"this optimizer's update: swap_core.register_adapter({optimizer_cls.__name__}, factory, name=...)"
        )


def check_instance_step(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an instance whose ``step`` was replaced; torch's LR-scheduler bookkeeping wrapper is fine."""
    patched = vars(optimizer).get("step")
    if patched is None:
        return
    # torch's LRScheduler wraps the bound class step to note that it was called, and nothing else.
    if is_lr_scheduler_step_wrapper(patched) and _unwrapped(patched) is _unwrapped(type(optimizer).step):
        return
    raise UnsupportedOptimizerError(
        f"This {type(optimizer).__name__}'s step was replaced on the instance ({patched!r}); a swapped optimizer "
        "never calls it. Wrap the plain optimizer, then patch or subclass the SwapOptimizer's step instead"
    )


def _defining_class(cls: type, name: str) -> type | None:
    return next((klass for klass in cls.__mro__ if name in klass.__dict__), None)


def _implementations(families: Sequence[type], name: str) -> set[Callable[..., Any]]:
    """The families' own functions for ``name``."""
    owners = (_defining_class(cls, name) for cls in families)
    return {_unwrapped(owner.__dict__[name]) for owner in owners if owner is not None}


def _unwrapped(function: Callable[..., Any]) -> Callable[..., Any]:
    """Past torch's decorators (``_use_grad_for_differentiable``, profiling hooks), to the defining function."""
    unwrapped: Callable[..., Any] = inspect.unwrap(function)
    return unwrapped


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
