"""torchtune: ``optimizer._component_`` naming the factory builds a swapped AdamW that steps bitwise like AdamW.

The recipe is examples/integrations/torchtune_factory.py; the optimizer is built as torchtune's
recipes build it, ``config.instantiate(cfg.optimizer, model.parameters())``. Runs in
``nox -s integrations`` (torchtune and the torchao it imports installed); skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from swap_core import SwapOptimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

omegaconf = pytest.importorskip("omegaconf")
torchtune_config = pytest.importorskip("torchtune.config")

STEPS = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        inputs = torch.randn(4, 16, generator=generator)
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("step", ["after_backward", "in_backward"])
def test_the_config_component_builds_a_swapped_adamw(step: str) -> None:
    """``in_backward``: the swapped counterpart of torchtune's ``optimizer_in_bwd`` (which builds one optimizer per
    parameter, nothing to stream in batches): keep ``optimizer_in_bwd: False`` and set ``swap.step``; the recipe's
    loop is unchanged, without ``clip_grad_norm`` and gradient accumulation, which the mode refuses."""
    swap = {"backend": "sim", "swap_times": 2, "min_numel": 64, "step": step}
    component = {"_component_": "torchtune_factory.swapped_adamw", "lr": 2e-3, "weight_decay": 0.01, "swap": swap}
    cfg = omegaconf.OmegaConf.create({"optimizer": component})
    model, plain_model = _model(), _model()
    optimizer = torchtune_config.instantiate(cfg.optimizer, model.parameters())
    assert isinstance(optimizer, SwapOptimizer) and isinstance(optimizer.optimizer, torch.optim.AdamW)
    assert isinstance(optimizer.backend, SimBackend) and optimizer.config.swap_times == 2
    assert optimizer.param_groups[0]["lr"] == 2e-3
    plain = torch.optim.AdamW(plain_model.parameters(), lr=2e-3, weight_decay=0.01)

    _train(model, optimizer)
    _train(plain_model, plain)
    assert optimizer.stats.h2d_bytes > 0
    if step == "in_backward":
        assert optimizer.stats.batches_in_backward == optimizer.stats.batches == 2
    for index, (expected, actual) in enumerate(zip(plain_model.parameters(), model.parameters(), strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert_state_dicts_equal(plain.state_dict(), optimizer.state_dict(), "optimizer")
