"""torchtitan: an OptimizersContainer subclass swapping its optimizers trains and checkpoints bitwise as the plain one.

The recipe is examples/integrations/torchtitan_container.py; the flat FQN-keyed state dict is
torchtitan's own (what its DCP checkpointer saves). Runs in ``nox -s integrations`` (torchtitan
installed); skipped elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer
from swap_core.config import StepMode
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal

optimizer_components = pytest.importorskip("torchtitan.components.optimizer")

from torchtitan_container import SwappedOptimizersContainer  # noqa: E402

FIRST, SECOND = 3, 2


class _FirstStage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input = torch.nn.Linear(16, 64)
        self.hidden = torch.nn.Linear(64, 64)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.hidden(torch.nn.functional.gelu(self.input(inputs)))


class _LastStage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.output = torch.nn.Linear(64, 8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(hidden))


def _model_parts() -> list[torch.nn.Module]:
    """Two pipeline stages of one model: their parameter FQNs are distinct, as torchtitan's splitting keeps them."""
    torch.manual_seed(0)
    return [_FirstStage(), _LastStage()]


def _train(parts: list[torch.nn.Module], optimizers: Any, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        hidden = parts[0](torch.randn(4, 16, generator=generator))
        parts[1](hidden).square().mean().backward()
        optimizers.step()
        optimizers.zero_grad()


def _swapped(parts: list[torch.nn.Module], implementation: str, seed: int, step: StepMode = "after_backward") -> Any:
    param_groups = optimizer_components.default_adamw(lr=1e-3).param_groups
    swap = SwapConfig(backend=SimBackend(mode="random", seed=seed), swap_times=2, min_numel=64, step=step)
    config = SwappedOptimizersContainer.Config(param_groups=param_groups, implementation=implementation, swap=swap)
    return config.build(model_parts=parts)


def _plain(parts: list[torch.nn.Module], implementation: str) -> Any:
    config = optimizer_components.default_adamw(lr=1e-3)
    config.implementation = implementation
    return config.build(model_parts=parts)


def _assert_equal(expected: list[torch.nn.Module], actual: list[torch.nn.Module], where: str) -> None:
    for part, (plain_part, swapped_part) in enumerate(zip(expected, actual, strict=True)):
        swapped_params = dict(swapped_part.named_parameters())
        for name, param in plain_part.named_parameters():
            assert_bitwise_equal(param, swapped_params[name], f"{where}: part {part} {name}")


def _assert_flat_equal(expected: dict[str, Any], actual: dict[str, Any], where: str) -> None:
    assert sorted(expected) == sorted(actual), f"{where}: keys differ"
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert_bitwise_equal(value, actual[key], f"{where}: {key}")
        else:
            assert value == actual[key], f"{where}: {key} is {actual[key]!r}, expected {value!r}"


@pytest.mark.parametrize("step", ["after_backward", "in_backward"])
@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_swapped_container_trains_and_checkpoints_bitwise(implementation: str, step: StepMode) -> None:
    """``in_backward``: the swapped counterpart of torchtitan's early step in backward (its
    ``OptimizersInBackwardContainer``), each optimizer's batches updating from the gradient hooks, the container's
    loop unchanged (without gradient clipping, which the mode refuses)."""
    plain_parts, swapped_parts = _model_parts(), _model_parts()
    plain = _plain(plain_parts, implementation)
    swapped = _swapped(swapped_parts, implementation, seed=1, step=step)
    assert type(swapped) is SwappedOptimizersContainer and len(swapped) == len(plain) == 2
    assert all(isinstance(optimizer, SwapOptimizer) for optimizer in swapped)

    _train(plain_parts, plain, FIRST, seed=2)
    _train(swapped_parts, swapped, FIRST, seed=2)
    assert all(optimizer.stats.h2d_bytes > 0 for optimizer in swapped)
    if step == "in_backward":
        assert all(optimizer.stats.batches_in_backward == optimizer.stats.batches for optimizer in swapped)
    _assert_equal(plain_parts, swapped_parts, "after the first steps")
    flat = swapped.state_dict()
    assert "state.input.weight.exp_avg" in flat and "state.output.weight.exp_avg_sq" in flat, sorted(flat)[:4]
    _assert_flat_equal(plain.state_dict(), flat, "flat state dict")

    # Resume the flat checkpoint into a new swapped container over copies of the parameters.
    resumed_parts = _model_parts()
    for resumed_part, swapped_part in zip(resumed_parts, swapped_parts, strict=True):
        resumed_part.load_state_dict(swapped_part.state_dict())
    resumed = _swapped(resumed_parts, implementation, seed=3, step=step)
    resumed.load_state_dict(flat)
    _train(plain_parts, plain, SECOND, seed=4)
    _train(resumed_parts, resumed, SECOND, seed=4)
    _assert_equal(plain_parts, resumed_parts, "after resuming")
    _assert_flat_equal(plain.state_dict(), resumed.state_dict(), "resumed flat state dict")
