"""An optimizer that pairs parameters through a dict of the real parameters is refused (issue 44, item 5).

LoRA-style optimizers update A and B together. Paired by position in a param group, the probe's stand-ins take
their places and the coupling shows; paired by identity (a dict keyed by the real parameters), the stand-ins are in
no pair, the probe sees a per-parameter step, and the swapped step, run batch by batch or inside the backward as each
batch's gradients become final, read the partner out of torch's order: silently wrong. Before: accepted.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.errors import UnsupportedOptimizerError
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

RANK = 4


class LoraPairs(torch.optim.SGD):
    """SGD with momentum that damps each LoRA factor's gradient by its partner's gradient norm, the pairs kept in
    a dict keyed by the parameters themselves (A to B and B to A)."""

    def __init__(self, params: list[torch.Tensor], partners: dict[torch.Tensor, torch.Tensor]) -> None:
        super().__init__(params, lr=0.05, momentum=0.9)
        self.partners = partners

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                partner = self.partners.get(param)
                if partner is not None and param.grad is not None and partner.grad is not None:
                    param.grad.div_(1 + partner.grad.norm())
        return super().step(closure)


def _lora() -> tuple[list[torch.Tensor], dict[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    shapes = ((RANK, 32), (24, RANK), (RANK, 20), (16, RANK))
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    partners = {params[0]: params[1], params[1]: params[0], params[2]: params[3], params[3]: params[2]}
    return params, partners


def _step(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(10 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()


@pytest.mark.parametrize("step", ["after_backward", "in_backward"])
def test_parameters_paired_through_a_dict_are_refused_before_anything_changes(step: str) -> None:
    params, partners = _lora()
    plain = LoraPairs(params, partners)
    twin_params, twin_partners = _lora()
    twin = LoraPairs(twin_params, twin_partners)
    for index in range(2):
        _step(params, plain, index)
        _step(twin_params, twin, index)
    checkpoint = copy.deepcopy(plain.state_dict())
    config = SwapConfig(backend=SimBackend(mode="random", seed=1), swap_times=2, min_numel=32, step=step)
    expected = (
        r"LoraPairs cannot be swapped: it holds one of its parameters outside its param groups \(parameter 0 of "
        r"param group 0, shape \(4, 32\), at LoraPairs\.partners\[<parameter of shape \(4, 32\)>\] \(a key\)\).*"
        r"Pair such parameters by their position in a param group.*declare LoraPairs\.swap_per_parameter = True"
    )
    with pytest.raises(UnsupportedOptimizerError, match=expected):
        swap_optimizer(plain, config)
    assert_state_dicts_equal(checkpoint, plain.state_dict(), "after the refused wrap")
    for index in range(2, 5):
        _step(params, plain, index)
        _step(twin_params, twin, index)
    for index, (want, got) in enumerate(zip(twin_params, params, strict=True)):
        assert_bitwise_equal(want, got, f"parameter {index}, 3 plain steps after the refused wrap")
    assert_state_dicts_equal(twin.state_dict(), plain.state_dict(), "3 plain steps after the refused wrap")


def test_a_declared_optimizer_holding_its_parameters_is_swapped_as_declared() -> None:
    params, partners = _lora()
    plain = LoraPairs(params, partners)
    plain.swap_per_parameter = True  # type: ignore[attr-defined]  # the user's word settles it, at their risk
    swap_optimizer(plain, SwapConfig(backend=SimBackend(), swap_times=2, min_numel=32))
