"""``swap_optimizer()``: the one-line entry that finds the adapter through the registry."""

from __future__ import annotations

import torch

from .adapters.registry import default_registry
from .config import SwapConfig
from .optimizer import SwapOptimizer

__all__ = ["swap_optimizer"]


def swap_optimizer(
    optimizer: torch.optim.Optimizer, config: SwapConfig | None = None, **overrides: object
) -> SwapOptimizer:
    """Wrap ``optimizer`` so its states live in host memory between steps.

    The adapter is looked up by the optimizer's class (and its bases) among the
    installed family packages; ``overrides`` replace fields of ``config``::

        opt = swap_optimizer(torch.optim.AdamW(model.parameters()), swap_times=8)
    """
    if isinstance(optimizer, SwapOptimizer):
        raise ValueError("The optimizer is already a SwapOptimizer; wrap the plain torch optimizer once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(_not_an_optimizer(optimizer))
    if config is None:
        config = SwapConfig()
    elif not isinstance(config, SwapConfig):
        raise TypeError(f"config must be a SwapConfig, got {type(config).__name__}")
    if overrides:
        config = config.replace(**overrides)
    factory = default_registry.resolve(optimizer)
    return SwapOptimizer(optimizer, config, factory)


def _not_an_optimizer(value: object) -> str:
    """What to say when ``swap_optimizer`` is given something other than an optimizer instance."""
    if isinstance(value, type) and issubclass(value, torch.optim.Optimizer):
        return (
            f"swap_optimizer() expects an optimizer instance, got the class {value.__name__}: build it first, "
            f"swap_optimizer({value.__name__}(model.parameters(), ...))"
        )
    what = type(value).__name__
    if isinstance(value, torch.Tensor) or hasattr(value, "__iter__"):
        return (
            f"swap_optimizer() expects a torch.optim.Optimizer instance, got a {what} (parameters?): build the "
            "optimizer first, swap_optimizer(torch.optim.AdamW(model.parameters(), lr=...))"
        )
    return f"swap_optimizer() expects a torch.optim.Optimizer instance, got a {what}"
