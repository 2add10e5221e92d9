"""A batch none of whose parameters has a gradient is not copied at all: torch's step skips such parameters too.

The numbers stay bitwise the plain optimizer's; ``opt.stats`` counts only the batches that moved. With batches
skipped between two that run, consecutive batches of a step can share a staging arena: the second is copied in
only once the first is copied out (the race checker and the lazy schedule check that order).
"""

from __future__ import annotations

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal

pytestmark = pytest.mark.sim_only

SHAPE = (40, 48)
PER_PARAM = 2 * 40 * 48 * 4  # RMSprop with momentum: square_avg and momentum_buffer, fp32


def _pair(sim: SimBackend, **options: object) -> tuple[list[torch.Tensor], torch.optim.Optimizer, list, object]:
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(SHAPE, generator=generator) for _ in range(8)]
    plain_params = [torch.nn.Parameter(value.clone()) for value in values]
    params = [torch.nn.Parameter(value.clone()) for value in values]
    config = SwapConfig(backend=sim, **{"swap_times": 8, "min_numel": 16, **options})  # type: ignore[arg-type]
    plain = torch.optim.RMSprop(plain_params, lr=0.01, momentum=0.9)
    return plain_params, plain, params, swap_optimizer(torch.optim.RMSprop(params, lr=0.01, momentum=0.9), config)


def _step(
    plain_params: list, plain: torch.optim.Optimizer, params: list, swapped: object, step: int, with_grad: set[int]
) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for index, (plain_param, param) in enumerate(zip(plain_params, params, strict=True)):
        grad = torch.randn(SHAPE, generator=generator)
        plain_param.grad = grad.clone() if index in with_grad else None
        param.grad = grad.clone() if index in with_grad else None
    plain.step()
    swapped.step()  # type: ignore[attr-defined]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("mode,seed", [("lazy", 0), ("sync", 0), *(("random", seed) for seed in range(6))])
def test_batches_without_gradients_are_not_copied_and_the_numbers_stay_torchs(
    mode: str, seed: int, packed: bool
) -> None:
    sim = SimBackend(mode=mode, seed=seed)  # type: ignore[arg-type]
    plain_params, plain, params, swapped = _pair(sim, packed=packed)
    everything = set(range(8))
    pattern = [everything, everything, {0, 3, 6}, set(), {7}, {1, 2}, everything, {0, 2, 4, 6}]
    for step, with_grad in enumerate(pattern):
        sim.reset_copy_stats()
        _step(plain_params, plain, params, swapped, step, with_grad)
        stats = swapped.stats  # type: ignore[attr-defined]
        # One parameter per batch: only the batches of the parameters with a gradient move.
        assert stats.h2d_bytes == stats.d2h_bytes == len(with_grad) * PER_PARAM, (step, stats)
        assert stats.batches == len(with_grad), (step, stats)
    swapped.synchronize()  # type: ignore[attr-defined]
    for index, (expected, actual) in enumerate(zip(plain_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
        assert_bitwise_equal(plain.state[expected]["square_avg"], swapped.state[actual]["square_avg"], f"state {index}")  # type: ignore[attr-defined]
    assert not sim.races, sim.races


def test_a_step_without_any_gradient_copies_nothing() -> None:
    sim = SimBackend(mode="lazy")
    plain_params, plain, params, swapped = _pair(sim)
    _step(plain_params, plain, params, swapped, 0, set(range(8)))
    sim.synchronize()
    sim.reset_copy_stats()
    _step(plain_params, plain, params, swapped, 1, set())
    assert sim.copy_stats.h2d_copies == sim.copy_stats.d2h_copies == 0
    assert swapped.stats.batches == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("buffers", [2, 3])
@pytest.mark.parametrize("mode,seed", [("lazy", 0), ("random", 3)])
def test_skipped_batches_never_raise_the_staging_above_the_plans_peak(
    packed: bool, buffers: int, mode: str, seed: int
) -> None:
    """Uneven batches, one parameter each, large and small in turn: a step that skips the small ones between two
    large ones must not hold both large ones at once (per tensor it did, twice the plan's peak with two buffers).
    The batch after a skipped one takes the memory of the one before it, once that one is copied out."""
    sim = SimBackend(mode=mode, seed=seed)  # type: ignore[arg-type]
    sizes = [256, 4096, 256, 4096, 256, 4096]
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(size, generator=generator) for size in sizes]
    plain_params = [torch.nn.Parameter(value.clone()) for value in values]
    params = [torch.nn.Parameter(value.clone()) for value in values]
    plain = torch.optim.Adam(plain_params, lr=0.01)
    config = SwapConfig(backend=sim, swap_times=6, min_numel=16, packed=packed, staging_buffers=buffers)
    swapped = swap_optimizer(torch.optim.Adam(params, lr=0.01), config)
    for step, with_grad in enumerate([set(range(6)), {1, 3, 5}, {0, 3}, set(range(6))]):
        sim.synchronize()
        before = sim.memory_allocated()
        sim.reset_peak_memory_stats()
        for index, (plain_param, param) in enumerate(zip(plain_params, params, strict=True)):
            grad = torch.randn(sizes[index], generator=generator)
            plain_param.grad = grad.clone() if index in with_grad else None
            param.grad = grad.clone() if index in with_grad else None
        plain.step()
        swapped.step()
        sim.synchronize()
        stats = swapped.stats
        claimed = stats.peak_state_device_bytes - stats.resident_state_device_bytes
        assert sim.max_memory_allocated() - before <= claimed, (step, sim.max_memory_allocated() - before, claimed)
        assert sim.memory_allocated() == before, f"step {step} leaked device bytes"
    for index, (expected, actual) in enumerate(zip(plain_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
        assert_bitwise_equal(plain.state[expected]["exp_avg"], swapped.state[actual]["exp_avg"], f"state {index}")
    assert not sim.races, sim.races
