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
    if config is None:
        config = SwapConfig()
    elif not isinstance(config, SwapConfig):
        raise TypeError(f"config must be a SwapConfig, got {type(config).__name__}")
    if overrides:
        config = config.replace(**overrides)
    factory = default_registry.resolve(optimizer)
    return SwapOptimizer(optimizer, config, factory)
