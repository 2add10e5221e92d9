"""Loading behaviour swap-core must share with torch.optim.Adam (found as gaps, fixed in swap-core).

A checkpoint without newer option keys gets the wrapped optimizer's defaults (its ``__setstate__``),
and state casting follows the saved groups' ``fused``/``capturable`` as in torch.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_state_dicts_equal

pytestmark = pytest.mark.sim_only


def _config() -> SwapConfig:
    return SwapConfig(backend=SimBackend(mode="lazy"), swap_times=2, min_numel=1)


def _both(run: Any) -> tuple[Any, Any]:
    return run(False), run(True)


def test_a_checkpoint_without_newer_option_keys_loads_as_into_torch() -> None:
    def run(swapped: bool) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(0)
        param = torch.nn.Parameter(torch.randn(100, generator=generator))
        source = torch.optim.AdamW([param], lr=1e-2)
        param.grad = torch.randn(100, generator=generator)
        source.step()
        old = copy.deepcopy(source.state_dict())
        for group in old["param_groups"]:  # as saved by a torch release before these options existed
            for key in ("maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"):
                del group[key]
        optimizer: torch.optim.Optimizer = torch.optim.AdamW([param], lr=1e-2)
        if swapped:
            optimizer = swap_optimizer(optimizer, _config())
        optimizer.load_state_dict(old)
        param.grad = torch.randn(100, generator=generator)
        optimizer.step()
        return optimizer.state_dict()

    expected, actual = _both(run)
    assert_state_dicts_equal(expected, actual, "old checkpoint")


def test_step_of_a_non_fused_checkpoint_keeps_its_dtype_in_a_fused_optimizer() -> None:
    def run(swapped: bool) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(0)
        param = torch.nn.Parameter(torch.randn(100, generator=generator, dtype=torch.float64))
        source = torch.optim.Adam([param], lr=1e-2)
        param.grad = torch.randn(100, generator=generator, dtype=torch.float64)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # non-fused Adam then keeps a float64 step
        try:
            source.step()
        finally:
            torch.set_default_dtype(previous)
        optimizer: torch.optim.Optimizer = torch.optim.Adam([param], lr=1e-2, fused=True)
        if swapped:
            optimizer = swap_optimizer(optimizer, _config())
        optimizer.load_state_dict(source.state_dict())
        return optimizer.state_dict()

    expected, actual = _both(run)
    assert expected["state"][0]["step"].dtype == torch.float64
    assert_state_dicts_equal(expected, actual, "fused optimizer loading a non-fused checkpoint")
