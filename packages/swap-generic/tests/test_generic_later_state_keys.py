"""A state key the optimizer adds after the step that created the state (issue 44, item 8).

An SWA-style optimizer keeps a running average of each parameter from some step on: the key appears in a state
that already exists. swap-generic checks a loaded or edited state against the keys the optimizer created; a key the
optimizer's own step adds (or drops) later is one a state may hold or lack, as torch's load takes either. Before:
the next ``add_param_group`` (its step) and every checkpoint load were refused ("did not create" that key).
"""

from __future__ import annotations

import copy
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


def _assert_swapped(optimizer: SwapOptimizer, params: list[torch.Tensor], keys: set[str], where: str) -> None:
    """Every parameter of at least 32 elements (the tests' ``min_numel``) has ``keys`` in host memory, no other
    parameter any."""
    layout = optimizer.host_layout()
    for index, param in enumerate(params):
        expected = keys if param.numel() >= 32 else set()
        assert layout.swapped_keys(param) == expected, f"{where}: parameter {index} swaps {layout.swapped_keys(param)}"


def test_a_key_added_to_an_existing_state_moves_to_host_memory_after_its_batch() -> None:
    """The average begins at the third step: it goes to host memory right after each batch adds it, as a fresh
    state's keys do (before: it stayed on the device, unswapped, until a checkpoint load). Bitwise the plain
    optimizer before and after."""
    twin_params, params = _params(), _params()
    twin, swapped = AveragesFrom(twin_params, start=2), _swapped(params, start=2)
    pairs = [(twin_params, twin), (params, swapped)]
    _step_both(pairs, range(2), "before the average")
    _assert_swapped(swapped, params, {"momentum_buffer"}, "before the average")
    momentum_only = swapped.stats.host_state_bytes
    _step_both(pairs, range(2, 3), "the step that begins the average")
    _assert_swapped(swapped, params, {"momentum_buffer", "average"}, "the step that began the average")
    assert swapped.stats.host_state_bytes > 2 * sum(param.numel() * 4 for param in params) > momentum_only
    assert swapped.stats.batches == 3
    _step_both(pairs, range(3, 6), "after the average began")


class _Layers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(inputs))


@pytest.mark.parametrize(
    "clip,provisional", [(False, True), (True, True), (False, False)], ids=["committed", "taken_back", "unprovisional"]
)
def test_inside_the_backward_a_key_added_to_an_existing_state_moves_to_host_memory_when_the_step_ends(
    clip: bool, provisional: bool
) -> None:
    """Inside the backward the average waits on the device for the step to end (a provisional walk's store is not
    added to): it moves to host memory once the step commits (or, without provisional updates, ends); a step taken
    back (clipped) drops it, and the step run
    again after the backward moves it after its batch. Bitwise the plain optimizer."""
    torch.manual_seed(0)
    model = _Layers()
    twin_model = copy.deepcopy(model)
    twin = AveragesFrom(twin_model.parameters(), start=3)
    config = SwapConfig(
        backend=SimBackend(mode="random", seed=2),
        swap_times=2,
        min_numel=32,
        step="in_backward",
        provisional_updates=provisional,
    )
    swapped = swap_optimizer(AveragesFrom(model.parameters(), start=3), config)
    inputs = torch.randn(4, 16)
    params = list(model.parameters())
    for step in range(6):
        for some_model, optimizer in ((twin_model, twin), (model, swapped)):
            some_model(inputs).pow(2).sum().backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(list(some_model.parameters()), 0.5)  # binds: taken back
            optimizer.step()
            optimizer.zero_grad()
        if step >= 1:  # the first step runs after the backward (no state yet)
            stats = swapped.stats
            assert (stats.batches_taken_back > 0) == clip and (stats.batches_in_backward > 0) != clip, stats
        keys = {"momentum_buffer", "average"} if step >= 3 else {"momentum_buffer"}  # the average begins at step 3
        _assert_swapped(swapped, params, keys, f"step {step}")
        for index, (want, got) in enumerate(zip(twin_model.parameters(), params, strict=True)):
            assert_bitwise_equal(want, got, f"step {step}: parameter {index}")
    assert_state_dicts_equal(twin.state_dict(), swapped.state_dict(), "after 6 steps")
