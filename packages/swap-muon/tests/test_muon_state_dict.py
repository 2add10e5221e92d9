"""Checkpoints of a swapped Muon are torch Muon checkpoints: same format, loadable both ways.

Everything goes through a file written by ``torch.save`` and read back with
``torch.load(weights_only=True)``, as a training script's checkpoint would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

SHAPES = ((16, 24), (24, 16), (4, 8), (12, 12))
MUON_OPTIONS: dict[str, Any] = {"lr": 2e-2, "weight_decay": 0.05, "adjust_lr_fn": "match_rms_adamw", "nesterov": False}


def make_params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def plain_muon(params: list[torch.nn.Parameter]) -> torch.optim.Muon:
    return torch.optim.Muon(params, **MUON_OPTIONS)


def swapped_muon(params: list[torch.nn.Parameter], packed: bool) -> SwapOptimizer:
    config = SwapConfig(backend=SimBackend(mode="random", seed=11), swap_times=2, min_numel=64, packed=packed)
    return swap_optimizer(plain_muon(params), config)


def step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, index: int) -> None:
    generator = torch.Generator().manual_seed(500 + index)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()


def save_and_load(state_dict: dict[str, Any], path: Path) -> dict[str, Any]:
    torch.save(state_dict, path)
    loaded: dict[str, Any] = torch.load(path, weights_only=True)
    return loaded


def assert_same_training(
    expected: tuple[list[torch.nn.Parameter], torch.optim.Optimizer],
    actual: tuple[list[torch.nn.Parameter], torch.optim.Optimizer],
    first_step: int,
    context: str,
) -> None:
    """Both continue five steps from their loaded states and stay bitwise equal."""
    for index in range(first_step, first_step + 5):
        step(*expected, index)
        step(*actual, index)
    for number, (mine, theirs) in enumerate(zip(expected[0], actual[0], strict=True)):
        assert_bitwise_equal(mine, theirs, f"{context}: parameter {number}")
    assert_state_dicts_equal(expected[1].state_dict(), actual[1].state_dict(), context)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_swapped_state_dict_is_torch_muons_format(packed: bool) -> None:
    reference_params, swapped_params = make_params(), make_params()
    reference, swapped = plain_muon(reference_params), swapped_muon(swapped_params, packed)
    for index in range(3):
        step(reference_params, reference, index)
        step(swapped_params, swapped, index)
    expected, actual = reference.state_dict(), swapped.state_dict()
    assert actual["param_groups"] == expected["param_groups"]
    assert {key: list(value) for key, value in actual["state"].items()} == {
        index: ["momentum_buffer"] for index in range(len(SHAPES))
    }
    assert all(state["momentum_buffer"].device.type == "cpu" for state in actual["state"].values())
    assert_state_dicts_equal(expected, actual, "after 3 steps")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_checkpoints_load_across_swapped_and_plain_muon(packed: bool, tmp_path: Path) -> None:
    reference_params, swapped_params = make_params(), make_params()
    reference, swapped = plain_muon(reference_params), swapped_muon(swapped_params, packed)
    for index in range(3):
        step(reference_params, reference, index)
        step(swapped_params, swapped, index)

    # swapped -> plain: a fresh plain Muon on copies of the swapped run's parameters.
    from_swapped = save_and_load(swapped.state_dict(), tmp_path / "swapped.pt")
    plain_params = [torch.nn.Parameter(param.detach().clone()) for param in swapped_params]
    plain = plain_muon(plain_params)
    plain.load_state_dict(from_swapped)
    assert_same_training((reference_params, reference), (plain_params, plain), 3, "swapped -> plain")

    # plain -> swapped: a fresh swapped Muon, its momentum loaded straight into host memory.
    from_plain = save_and_load(reference.state_dict(), tmp_path / "plain.pt")
    restored_params = [torch.nn.Parameter(param.detach().clone()) for param in reference_params]
    restored = swapped_muon(restored_params, packed)
    restored.load_state_dict(from_plain)
    assert_same_training((reference_params, reference), (restored_params, restored), 8, "plain -> swapped")

    # swapped -> swapped, the resume path of a swapped training run.
    from_restored = save_and_load(restored.state_dict(), tmp_path / "restored.pt")
    resumed_params = [torch.nn.Parameter(param.detach().clone()) for param in restored_params]
    resumed = swapped_muon(resumed_params, not packed)
    resumed.load_state_dict(from_restored)
    assert_same_training((reference_params, reference), (resumed_params, resumed), 13, "swapped -> swapped")
    for optimizer in (swapped, restored, resumed):
        assert not optimizer.backend.races  # type: ignore[union-attr]
