"""The private torch APIs swap-generic relies on, fenced in one module.

Each function names the private attribute it reads and the torch versions it was checked against;
when torch moves one, it raises :class:`TorchCompatError` saying which. ``tests/test_generic_torch_compat.py``
exercises each of them. Checked against torch 2.13.0.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer

from swap_core.torch_compat import hook_registries_set_aside

__all__ = ["TorchCompatError", "step_hooks_silenced", "tensor_version", "unhooked_step"]

_INSTANCE_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
_GLOBAL_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


class TorchCompatError(RuntimeError):
    """A private torch API that swap-generic relies on has moved; the message names it."""


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
    """``type(optimizer).step`` one level below torch's hook and profiler wrapper, bound to ``optimizer``.

    ``Optimizer.__init__`` replaces the class's ``step`` by ``Optimizer.profile_hook_step(step)``
    (marked ``hooked``), which runs the step hooks around it; the function it wraps (its
    ``__wrapped__``, from ``functools.wraps``) keeps the class's own decorators, such as
    ``_use_grad_for_differentiable`` (checked: torch 2.13).
    """
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        inner = getattr(step, "__wrapped__", None)
        if not callable(inner):
            raise TorchCompatError(
                f"{type(optimizer).__name__}.step is hooked by torch but has no __wrapped__ function (checked "
                "against torch 2.13): swap_generic.torch_compat.unhooked_step needs updating for this torch"
            )
        step = inner
    return functools.partial(step, optimizer)


@contextlib.contextmanager
def step_hooks_silenced(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """No step pre/post hook runs inside the block, neither ``optimizer``'s own nor the global ones.

    A subclass whose ``step`` calls ``super().step()`` reaches the parent's hooked ``step`` (once
    any instance of the parent exists), which would run the hooks once per batch. The hooks live in
    ``optimizer._optimizer_step_pre_hooks``/``_post_hooks`` and in the module dicts
    ``torch.optim.optimizer._global_optimizer_pre_hooks``/``_post_hooks`` (checked: torch 2.13);
    each is replaced by an empty dict for the block and put back after it.
    """
    for name in _GLOBAL_HOOKS:
        if not isinstance(getattr(torch_optimizer, name, None), dict):
            raise TorchCompatError(
                f"torch.optim.optimizer.{name} is gone (checked against torch 2.13): "
                "swap_generic.torch_compat.step_hooks_silenced needs updating for this torch"
            )
    saved_global = {name: getattr(torch_optimizer, name) for name in _GLOBAL_HOOKS}
    try:
        for name in saved_global:
            setattr(torch_optimizer, name, OrderedDict())
        with hook_registries_set_aside(optimizer, _INSTANCE_HOOKS):
            yield
    finally:
        for name, hooks in saved_global.items():
            setattr(torch_optimizer, name, hooks)


def tensor_version(tensor: torch.Tensor) -> int:
    """How often ``tensor`` was written in place: autograd's version counter ``tensor._version``
    (checked: torch 2.13)."""
    version = getattr(tensor, "_version", None)
    if not isinstance(version, int):
        raise TorchCompatError(
            "torch.Tensor._version is gone (checked against torch 2.13): "
            "swap_generic.torch_compat.tensor_version needs updating for this torch"
        )
    return version
