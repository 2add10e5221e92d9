"""Adapters whose update creates the states (``lazy_states``), as an optimizer's own step does.

A test double stands in for such an adapter: SGD with momentum whose update creates the momentum
buffer on a parameter's first step (torch's single-tensor SGD, written out). The runtime must spread
the first step's fresh states over the batches, move them to host memory right after their batch,
pack them after the step, and take over a state the update replaced by a new tensor.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer
from swap_core.adapters.base import StateInit, StateSwapAdapter, UpdateBatch
from swap_core.errors import SwapStateError, UnsupportedOptimizerError
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

SHAPES = ((48, 40), (40, 30), (2000,), (8,), (33, 31), (64, 20))
LR, MOMENTUM = 0.05, 0.9


class LazyMomentumAdapter(StateSwapAdapter):
    """SGD(momentum=0.9) whose update creates ``momentum_buffer`` when a parameter has none."""

    swappable_keys = None
    lazy_states = True
    replace_buffer = False
    """Assign a new buffer tensor every step (instead of writing the existing one in place)."""

    def initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor | StateInit]:
        raise AssertionError("the runtime never asks a lazy adapter for a fresh state")

    def update(self, batch: UpdateBatch) -> None:
        for param, grad in zip(batch.params, batch.grads, strict=True):
            entry = self.optimizer.state[param]  # created here, as torch's step creates it
            buffer = entry.get("momentum_buffer")
            if buffer is None:
                buffer = torch.clone(grad).detach()
            elif self.replace_buffer:
                buffer = buffer * MOMENTUM + grad
            else:
                buffer.mul_(MOMENTUM).add_(grad)
            entry["momentum_buffer"] = buffer
            param.add_(buffer, alpha=-LR)


def _params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(10 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def _pair(backend: SimBackend, adapter: type[LazyMomentumAdapter] = LazyMomentumAdapter, **options: Any) -> Any:
    reference_params, swapped_params = _params(), _params()
    reference = torch.optim.SGD(reference_params, lr=LR, momentum=MOMENTUM, foreach=False)
    config = SwapConfig(backend=backend, swap_times=3, min_numel=64, **options)
    swapped = SwapOptimizer(torch.optim.SGD(swapped_params, lr=LR, momentum=MOMENTUM, foreach=False), config, adapter)
    return reference_params, reference, swapped_params, swapped


def _step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, step: int) -> None:
    _set_grads(params, step)
    optimizer.step()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("mode,seed", [("lazy", 0), ("sync", 0), ("random", 1), ("random", 2)])
def test_fresh_states_are_created_batch_by_batch_and_swapped(packed: bool, mode: str, seed: int) -> None:
    backend = SimBackend(mode=mode, seed=seed)
    reference_params, reference, swapped_params, swapped = _pair(backend, packed=packed)
    for step in range(5):
        _step(reference_params, reference, step)
        _step(swapped_params, swapped, step)
        for index, (expected, actual) in enumerate(zip(reference_params, swapped_params, strict=True)):
            assert_bitwise_equal(expected, actual, f"step {step}: parameter {index}")
        # The first step too spreads the parameters over the batches: its fresh states never are all on the device.
        assert swapped.stats.batches == 3, f"step {step}: {swapped.stats.batches} batches"
        assert not swapped.host_layout().has_unpacked
    swapped.synchronize()
    swapped_bytes = sum(param.numel() * 4 for param in swapped_params if param.numel() >= 64)
    assert swapped.stats.host_state_bytes >= swapped_bytes
    for param in swapped_params:
        on_device = backend.owns(swapped.state[param]["momentum_buffer"])
        assert on_device == (param.numel() < 64), f"momentum of a {tuple(param.shape)} parameter"
    assert_state_dicts_equal(reference.state_dict(), swapped.state_dict(), "after 5 steps")
    assert not backend.races


def test_state_keys_of_any_name_are_accepted_when_the_family_declares_none() -> None:
    backend = SimBackend(mode="lazy")
    _, _, swapped_params, swapped = _pair(backend, state_keys=("not_a_key_of_sgd",))
    _step(swapped_params, swapped, 0)
    _step(swapped_params, swapped, 1)
    assert swapped.stats.h2d_bytes == 0 and swapped.stats.host_state_bytes == 0  # nothing of that name


def test_initialize_state_is_refused_for_an_adapter_whose_update_creates_states() -> None:
    *_, swapped = _pair(SimBackend(mode="lazy"))
    with pytest.raises(UnsupportedOptimizerError, match=r"initialize_state\(\) cannot create the states of SGD"):
        swapped.initialize_state()
    assert not swapped.state


class _FailingInBatch1(LazyMomentumAdapter):
    armed = True

    def update(self, batch: UpdateBatch) -> None:
        if batch.batch_index == 1 and self.armed:
            raise RuntimeError("update fault in batch 1")
        super().update(batch)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_a_first_step_failing_part_way_is_undone_and_the_next_steps_are_exact(packed: bool) -> None:
    """Batch 0 created its states and updated its parameters before batch 1 failed: both are undone
    (test_failed_step.py has the other families), and the steps after are the plain optimizer's."""
    backend = SimBackend(mode="random", seed=3)
    reference_params, reference, swapped_params, swapped = _pair(backend, _FailingInBatch1, packed=packed)
    _set_grads(swapped_params, 0)
    with pytest.raises(RuntimeError, match="update fault in batch 1"):
        swapped.step()
    assert not any(swapped.state.get(param) for param in swapped_params), "the states the failed step made are gone"
    for index, (expected, actual) in enumerate(zip(reference_params, swapped_params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} after the failed step")
    assert type(swapped.adapter).__name__ == "_FailingInBatch1"
    swapped.adapter.armed = False  # type: ignore[attr-defined]
    for step in range(3):
        _step(reference_params, reference, step)
        _step(swapped_params, swapped, step)
    assert not swapped.host_layout().has_unpacked
    for index, (expected, actual) in enumerate(zip(reference_params, swapped_params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} after the recovered steps")
    assert_state_dicts_equal(reference.state_dict(), swapped.state_dict(), "after the recovered steps")


class _ReplacingAdapter(LazyMomentumAdapter):
    replace_buffer = True


def test_a_state_the_update_replaces_by_a_new_tensor_is_taken_over() -> None:
    reference_params, reference, swapped_params, swapped = _pair(SimBackend(mode="random", seed=4), _ReplacingAdapter)
    for step in range(4):
        _step(reference_params, reference, step)
        _step(swapped_params, swapped, step)
    for index, (expected, actual) in enumerate(zip(reference_params, swapped_params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert_state_dicts_equal(reference.state_dict(), swapped.state_dict(), "after 4 steps")


class _ReshapingAdapter(LazyMomentumAdapter):
    reshape = False

    def update(self, batch: UpdateBatch) -> None:
        super().update(batch)
        if self.reshape:
            for param in batch.params:
                entry = self.optimizer.state[param]
                entry["momentum_buffer"] = entry["momentum_buffer"].flatten()[:10]


def test_a_state_the_update_replaces_by_another_shape_is_refused_naming_it() -> None:
    *_, swapped_params, swapped = _pair(SimBackend(mode="lazy"), _ReshapingAdapter)
    _step(swapped_params, swapped, 0)
    swapped.adapter.reshape = True  # type: ignore[attr-defined]
    _set_grads(swapped_params, 1)
    with pytest.raises(SwapStateError, match=r"replaced swapped state 'momentum_buffer' \(\(48, 40\) torch.float32\)"):
        swapped.step()
