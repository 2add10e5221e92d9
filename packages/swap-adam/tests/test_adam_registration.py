"""swap-adam is found through the ``swap_core.adapters`` entry point, for Adam, AdamW and subclasses."""

from __future__ import annotations

import importlib.metadata

import torch

import swap_adam
from swap_core import swap_optimizer
from swap_core.adapters.registry import ENTRY_POINT_GROUP, AdapterRegistry, default_registry


def test_entry_point_is_installed() -> None:
    installed = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    entry_points = {entry_point.name: entry_point for entry_point in installed}
    assert entry_points["adam"].value == "swap_adam:register"
    assert entry_points["adam"].load() is swap_adam.register
    assert importlib.metadata.version("swap-adam") == swap_adam.__version__ == "0.1.0"


def test_register_serves_adam_adamw_and_subclasses() -> None:
    registry = AdapterRegistry(entry_points=lambda: ())
    swap_adam.register(registry)
    assert registry.registered() == {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}

    class Subclass(torch.optim.AdamW):
        pass

    param = torch.nn.Parameter(torch.zeros(4))
    for optimizer in (torch.optim.Adam([param]), torch.optim.AdamW([param]), Subclass([param])):
        assert registry.resolve(optimizer) is swap_adam.AdamAdapter


def test_swap_optimizer_finds_the_adapter_through_the_default_registry() -> None:
    assert default_registry.registered()["adam"] is torch.optim.Adam
    optimizer = swap_optimizer(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))]), backend="sim")
    assert isinstance(optimizer.adapter, swap_adam.AdamAdapter)
    assert optimizer.adapter.swappable_keys == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
