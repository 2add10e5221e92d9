"""The wrapped optimizer's methods that read and write parameters and states outside ``step()`` (schedule-free's
``train()`` and ``eval()``), run through its wrapper so that they see current states."""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from ..adapters.base import StateSwapAdapter
from .wrapping import WRAPPERS, Wrapper

__all__ = ["OutsideStepRedirect", "check_outside_step_methods", "offer_outside_step_methods"]


def check_outside_step_methods(
    wrapper_type: type[torch.optim.Optimizer], optimizer: torch.optim.Optimizer, adapter: StateSwapAdapter
) -> None:
    """Refuse, before anything changes, a name the adapter declares that the optimizer's class lacks."""
    for name in adapter.outside_step_methods:
        if not callable(getattr(type(optimizer), name, None)) or hasattr(wrapper_type, name):
            raise TypeError(
                f"{type(adapter).__name__} declares {name!r} as a method of {type(optimizer).__name__} "
                "run outside step(), but the optimizer's class has no such method (or SwapOptimizer has one)"
            )


def offer_outside_step_methods(wrapper: Wrapper, adapter: StateSwapAdapter) -> None:
    """``swapped.eval()`` and the wrapped optimizer's own ``eval()`` both run :meth:`SwapOptimizer.outside_step`."""
    for name in adapter.outside_step_methods:
        wrapper.__dict__[name] = functools.partial(wrapper.outside_step, name)
        wrapper.optimizer.__dict__[name] = OutsideStepRedirect(wrapper.optimizer, name)


class OutsideStepRedirect:
    """The wrapped optimizer's own ``eval`` (say): runs its wrapper's :meth:`SwapOptimizer.outside_step`.

    Without a live wrapper (a deep copy of the wrapped optimizer, or one whose wrapper is gone) it runs the
    class's method, as the plain optimizer would.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, name: str) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = self._optimizer()
        if optimizer is None:
            raise ReferenceError(f"the optimizer of this {self._name}() is gone")
        reference = WRAPPERS.get(optimizer)
        wrapper = reference() if reference is not None else None
        if wrapper is None or wrapper.optimizer is not optimizer:
            return getattr(type(optimizer), self._name)(optimizer, *args, **kwargs)
        return wrapper.outside_step(self._name, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> OutsideStepRedirect:
        optimizer = self._optimizer()
        if optimizer is None:
            return self
        return OutsideStepRedirect(memo.get(id(optimizer), optimizer), self._name)
