"""A state key the optimizer adds after the step that created the state (issue 44, item 8).

An SWA-style optimizer keeps a running average of each parameter from some step on: the key appears in a state
that already exists. swap-generic checks a loaded or edited state against the keys the optimizer created; a key the
optimizer's own step adds (or drops) later is one a state may hold or lack, as torch's load takes either. Before:
the next ``add_param_group`` (its step) and every checkpoint load were refused ("did not create" that key).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.errors import StateDictMismatchError
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_core.testing.pairs import through_torch_save

SHAPES = ((16, 20), (8, 8), (30, 12), (40,))


class AveragesFrom(torch.optim.SGD):
    """SGD with momentum that averages each parameter from its ``start``-th step on (``"average"``, added to the
    state then; its step count ``"steps"`` kept beside it)."""

    def __init__(self, params: Any, start: int = 1) -> None:
        super().__init__(params, lr=0.05, momentum=0.9)
        self.start = start

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = super().step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                steps = state.get("steps", 0) + 1
                state["steps"] = steps
                if steps == self.start + 1:
                    state["average"] = param.detach().clone()
                elif steps > self.start + 1:
                    state["average"].lerp_(param, 1 / (steps - self.start))
        return loss


def _params(shapes: tuple[tuple[int, ...], ...] = SHAPES, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def _grads(params: list[torch.Tensor], step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def _swapped(params: list[torch.Tensor], start: int) -> SwapOptimizer:
    config = SwapConfig(backend=SimBackend(mode="random", seed=7), swap_times=3, min_numel=32)
    return swap_optimizer(AveragesFrom(params, start), config)


def _stepped_alone(start: int, steps: int) -> tuple[list[torch.Tensor], SwapOptimizer]:
    """A swapped optimizer and its parameters after ``steps`` steps."""
    params = _params()
    swapped = _swapped(params, start)
    for step in range(steps):
        _grads(params, step)
        swapped.step()
    return params, swapped


def _step_both(pairs: list[tuple[list[torch.Tensor], torch.optim.Optimizer]], steps: range, where: str) -> None:
    for step in steps:
        for params, optimizer in pairs:
            _grads(params, step)
            optimizer.step()
    (expected_params, expected), (actual_params, actual) = pairs
    for index, (want, got) in enumerate(zip(expected_params, actual_params, strict=True)):
        assert_bitwise_equal(want, got, f"{where}: parameter {index}")
    assert_state_dicts_equal(expected.state_dict(), actual.state_dict(), where)


# start 1: the probe sees the key added at the second step; start 4: only the swapped steps do.
@pytest.mark.parametrize("start", [1, 4])
def test_a_key_added_after_the_first_step_survives_add_param_group_and_checkpoints_bitwise(start: int) -> None:
    twin_params, params = _params(), _params()
    twin = AveragesFrom(twin_params, start)
    swapped = _swapped(params, start)
    _step_both([(twin_params, twin), (params, swapped)], range(start + 3), "before add_param_group")
    assert "average" in swapped.state[params[0]]
    twin_params.append(torch.nn.Parameter(torch.ones(6, 6)))
    params.append(torch.nn.Parameter(torch.ones(6, 6)))
    twin.add_param_group({"params": [twin_params[-1]]})
    swapped.add_param_group({"params": [params[-1]]})
    pairs = [(twin_params, twin), (params, swapped)]
    _step_both(pairs, range(start + 3, start + 6), "after add_param_group")
    checkpoint = through_torch_save(swapped.state_dict())
    for _, optimizer in pairs:
        optimizer.load_state_dict(checkpoint)
    _step_both(pairs, range(start + 6, start + 8), "after loading its own checkpoint")
    lacking = through_torch_save(swapped.state_dict())
    for state in lacking["state"].values():
        state.pop("average")  # as saved before the average began: torch's load takes it, and the step adds it again
        state["steps"] = start - 1
    for _, optimizer in pairs:
        optimizer.load_state_dict(lacking)
    _step_both(pairs, range(start + 8, start + 11), "after loading a checkpoint without the later key")


def test_a_checkpoint_with_the_later_key_loads_into_an_optimizer_stepped_before_the_key_begins() -> None:
    """The probe saw the key begin at the second step: a checkpoint holding it loads after one step, as in torch."""
    twin_params, params = _params(), _params()
    twin, swapped = AveragesFrom(twin_params), _swapped(params, start=1)
    checkpoint = through_torch_save(_stepped_alone(start=1, steps=3)[1].state_dict())
    pairs = [(twin_params, twin), (params, swapped)]
    _step_both(pairs, range(1), "one step, no average yet")
    assert "average" not in swapped.state[params[0]]
    for _, optimizer in pairs:
        optimizer.load_state_dict(checkpoint)
    _step_both(pairs, range(3, 6), "after loading a checkpoint with the average")


def test_a_key_the_optimizer_never_adds_is_still_refused_at_load() -> None:
    _, swapped = _stepped_alone(start=1, steps=3)
    checkpoint = through_torch_save(swapped.state_dict())
    before = through_torch_save(swapped.state_dict())
    checkpoint["state"][0]["extra"] = torch.zeros(3)
    with pytest.raises(StateDictMismatchError, match=r"'extra', which AveragesFrom did not create"):
        swapped.load_state_dict(checkpoint)
    assert_state_dicts_equal(before, swapped.state_dict(), "after the refused load")
