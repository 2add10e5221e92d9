"""Adam-specific torch habits beyond the conformance suite's generic ones (swap_core.testing.habits).

Non-contiguous parameters under the fused kernel (which reads memory in order), and checkpoints that
lack what Adam's step reads or carry what it never creates.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.errors import StateDictMismatchError, SwapStateError
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_core.testing.conformance import through_torch_save

MOMENTS = ("exp_avg", "exp_avg_sq")


def _odd_layout_params() -> list[torch.Tensor]:
    """A channels-last Conv2d weight, its bias, a transposed matrix and a contiguous one (seeded, so twins match)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 16, 3).to(memory_format=torch.channels_last)
    transposed = torch.nn.Parameter(torch.randn(40, 24).t())
    return [conv.weight, conv.bias, transposed, torch.nn.Parameter(torch.randn(30, 20))]


def _grads(params: list[torch.Tensor], step: int) -> None:
    generator = torch.Generator().manual_seed(500 + step)
    for param in params:
        # AccumulateGrad gives a gradient its parameter's memory layout; so do these.
        param.grad = torch.empty_like(param).copy_(torch.randn(param.shape, generator=generator))


def _config(**options: Any) -> SwapConfig:
    return SwapConfig(backend=SimBackend(mode="random", seed=3), **{"swap_times": 2, "min_numel": 16, **options})


def _step(optimizers: list[torch.optim.Optimizer], param_sets: list[list[torch.Tensor]], steps: range) -> None:
    for step in steps:
        for optimizer, params in zip(optimizers, param_sets, strict=True):
            _grads(params, step)
            optimizer.step()


def _assert_same_layouts(expected: dict[str, Any], actual: dict[str, Any], context: str) -> None:
    assert_state_dicts_equal(expected, actual, context)
    for index, state in expected["state"].items():
        for key in MOMENTS:
            want, got = state[key].stride(), actual["state"][index][key].stride()
            assert want == got, f"{context}: {key} of parameter {index} has strides {got}, torch's has {want}"


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("min_numel", [16, 100_000], ids=["swapped", "resident"])
def test_fused_adamw_keeps_the_moments_in_the_parameters_memory_order(packed: bool, min_numel: int) -> None:
    reference_params, params = _odd_layout_params(), _odd_layout_params()
    assert not reference_params[0].is_contiguous() and not reference_params[2].is_contiguous()
    reference = torch.optim.AdamW(reference_params, lr=1e-2, fused=True)
    swapped = swap_optimizer(
        torch.optim.AdamW(params, lr=1e-2, fused=True), _config(packed=packed, min_numel=min_numel)
    )
    _step([reference, swapped], [reference_params, params], range(4))
    for index, (want, got) in enumerate(zip(reference_params, params, strict=True)):
        assert_bitwise_equal(want, got, f"parameter {index}")
    _assert_same_layouts(reference.state_dict(), swapped.state_dict(), "fused AdamW, odd layouts")


def test_fused_checkpoints_of_odd_layouts_resume_both_ways() -> None:
    """Swapped fused -> plain (fused and not), plain fused -> swapped fused: every run continues exactly."""
    reference_params, params = _odd_layout_params(), _odd_layout_params()
    reference = torch.optim.AdamW(reference_params, lr=1e-2, fused=True)
    swapped = swap_optimizer(torch.optim.AdamW(params, lr=1e-2, fused=True), _config())
    _step([reference, swapped], [reference_params, params], range(3))
    for fused in (True, False):
        resumed_params = [param.detach().clone().requires_grad_() for param in params]
        continued_params = [param.detach().clone().requires_grad_() for param in reference_params]
        resumed = torch.optim.AdamW(resumed_params, lr=1e-2, fused=fused)
        resumed.load_state_dict(through_torch_save(swapped.state_dict()))
        continued = torch.optim.AdamW(continued_params, lr=1e-2, fused=fused)
        continued.load_state_dict(through_torch_save(reference.state_dict()))
        _step([resumed, continued], [resumed_params, continued_params], range(3, 6))
        for index, (want, got) in enumerate(zip(continued_params, resumed_params, strict=True)):
            assert_bitwise_equal(want, got, f"fused={fused} resumed from the swapped checkpoint: parameter {index}")
    fresh = swap_optimizer(torch.optim.AdamW(params, lr=1e-2, fused=True), _config())
    del swapped
    fresh.load_state_dict(through_torch_save(reference.state_dict()))
    _step([reference, fresh], [reference_params, params], range(3, 6))
    for index, (want, got) in enumerate(zip(reference_params, params, strict=True)):
        assert_bitwise_equal(want, got, f"plain fused checkpoint resumed swapped: parameter {index}")
    _assert_same_layouts(reference.state_dict(), fresh.state_dict(), "after a plain fused checkpoint")


def _stepped_pair(**options: Any) -> tuple[torch.optim.Optimizer, Any, list[torch.Tensor], list[torch.Tensor]]:
    shapes = [(48, 40), (64,), (32, 33)]
    generator = torch.Generator().manual_seed(1)
    reference_params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    params = [torch.nn.Parameter(param.detach().clone()) for param in reference_params]
    reference = torch.optim.AdamW(reference_params, lr=1e-2, **options)
    swapped = swap_optimizer(torch.optim.AdamW(params, lr=1e-2, **options), _config(swap_times=3))
    _step([reference, swapped], [reference_params, params], range(2))
    return reference, swapped, reference_params, params


@pytest.mark.parametrize(
    ("options", "index", "edit", "words"),
    [
        ({}, 2, lambda state: state.pop("exp_avg_sq"), "lacks 'exp_avg_sq'"),
        ({"amsgrad": True}, 2, lambda state: state.pop("max_exp_avg_sq"), "lacks 'max_exp_avg_sq'"),
        ({}, 1, lambda state: state.__setitem__("momentum_buffer", torch.zeros(64)), "has 'momentum_buffer'"),
    ],
    ids=["no_exp_avg_sq", "amsgrad_no_max_exp_avg_sq", "momentum_buffer"],
)
def test_incomplete_or_foreign_checkpoints_are_refused_at_load_naming_the_parameter(
    options: dict[str, Any], index: int, edit: Any, words: str
) -> None:
    reference, swapped, reference_params, params = _stepped_pair(**options)
    bad = through_torch_save(reference.state_dict())
    edit(bad["state"][index])
    before = copy.deepcopy(swapped.state_dict())
    with pytest.raises(StateDictMismatchError, match=rf"parameter {index} .*{words}"):
        swapped.load_state_dict(bad)
    assert_state_dicts_equal(before, swapped.state_dict(), "state after the refused load")
    _step([reference, swapped], [reference_params, params], range(2, 4))
    for position, (want, got) in enumerate(zip(reference_params, params, strict=True)):
        assert_bitwise_equal(want, got, f"parameter {position} after the refused load")


def test_a_checkpoint_lacking_a_moment_loaded_through_the_plain_optimizer_never_half_steps() -> None:
    """torch's own load takes it; the swapped step refuses it before batch 0 (not with KeyError after batch 1)."""
    reference, swapped, _reference_params, params = _stepped_pair()
    bad = through_torch_save(reference.state_dict())
    del bad["state"][2]["exp_avg_sq"]  # the last parameter: in the last batch
    swapped.optimizer.load_state_dict(bad)
    before = [param.detach().clone() for param in params]
    _grads(params, 2)
    with pytest.raises(SwapStateError, match=r"parameter 2 \(param group 0, shape \(32, 33\)\) lacks 'exp_avg_sq'"):
        swapped.step()
    for index, (saved, param) in enumerate(zip(before, params, strict=True)):
        assert_bitwise_equal(saved, param, f"parameter {index} after the refused step")
