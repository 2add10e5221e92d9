"""The private torch APIs swap-generic relies on, fenced in one module.

Each function names the private attribute it reads and the torch versions it was checked against;
when torch moves one, it raises :class:`TorchCompatError` saying which. ``tests/test_generic_torch_compat.py``
exercises each of them. Checked against torch 2.13.0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TorchCompatError", "unhooked_step"]


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
