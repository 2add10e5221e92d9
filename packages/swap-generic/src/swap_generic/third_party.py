"""What swap-generic refuses in third-party optimizers, read from their attributes (checked: bitsandbytes 0.50.2)."""

from __future__ import annotations

import torch

__all__ = ["outside_step_methods", "third_party_refusal"]


def third_party_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why a third-party optimizer cannot be swapped batch by batch, or ``None``."""
    if type(optimizer).__module__.split(".")[0] == "bitsandbytes":
        return _bitsandbytes_refusal(optimizer)
    return None


def _bitsandbytes_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    if getattr(optimizer, "is_paged", False):
        return (
            "a paged bitsandbytes optimizer keeps its states in CUDA unified memory, which the driver already pages "
            "to host memory; swap its unpaged twin instead (AdamW8bit for PagedAdamW8bit)"
        )
    manager = getattr(optimizer, "mng", None)
    overrides = [getattr(manager, name, None) for name in ("pid2config", "index2config", "module_weight_config_triple")]
    if any(overrides):
        return (
            "bitsandbytes' GlobalOptimManager holds per-parameter overrides, which it looks up by position in the "
            "param groups, and a batch changes those positions; put the overridden parameters in a param group of "
            "their own with those options instead"
        )
    return None


def outside_step_methods(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """Methods of ``optimizer`` that move its parameters outside ``step()``: schedule-free's ``train``/``eval``."""
    if any("train_mode" in group for group in optimizer.param_groups):
        return tuple(name for name in ("train", "eval") if callable(getattr(type(optimizer), name, None)))
    return ()
