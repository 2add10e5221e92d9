"""``torch.compile(opt.step)`` and CUDA-graph capture of a swapped step: run eagerly, or refused before any change."""

from __future__ import annotations

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal

pytestmark = pytest.mark.sim_only


def _pair(
    sim: SimBackend,
) -> tuple[list[torch.Tensor], torch.optim.Optimizer, list[torch.Tensor], torch.optim.Optimizer]:
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(40, 48, generator=generator) for _ in range(3)]
    plain_params = [torch.nn.Parameter(value.clone()) for value in values]
    params = [torch.nn.Parameter(value.clone()) for value in values]
    swapped = swap_optimizer(torch.optim.RMSprop(params, lr=0.01), SwapConfig(backend=sim, swap_times=2, min_numel=16))
    return plain_params, torch.optim.RMSprop(plain_params, lr=0.01), params, swapped


def _grads(step: int, *param_lists: list[torch.Tensor]) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(param.shape, generator=generator) for param in param_lists[0]]
    for params in param_lists:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()


def test_a_compiled_step_runs_the_swapped_step_as_it_is() -> None:
    sim = SimBackend(mode="lazy")
    plain_params, plain, params, swapped = _pair(sim)
    compiled = torch.compile(swapped.step)
    for step in range(3):
        _grads(step, plain_params, params)
        plain.step()
        compiled()
    for index, (expected, actual) in enumerate(zip(plain_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert not sim.races


class _CapturingSim(SimBackend):
    """A simulator whose current stream is capturing a CUDA graph."""

    capturing = False

    def is_capturing(self) -> bool:
        return self.capturing


def test_a_step_while_the_stream_captures_a_graph_is_refused_before_anything_changes() -> None:
    sim = _CapturingSim(mode="lazy")
    plain_params, plain, params, swapped = _pair(sim)
    _grads(0, plain_params, params)
    plain.step()
    swapped.step()
    before = [param.detach().clone() for param in params]
    _grads(1, plain_params, params)
    sim.capturing = True
    with pytest.raises(RuntimeError, match=r"cannot be captured in a CUDA graph.*call step\(\) outside the graph"):
        swapped.step()
    for index, (expected, actual) in enumerate(zip(before, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} after the refused step")
    sim.capturing = False
    plain.step()
    swapped.step()
    for index, (expected, actual) in enumerate(zip(plain_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
