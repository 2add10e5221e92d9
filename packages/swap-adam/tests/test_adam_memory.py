"""Device memory and copies of swapped Adam state, measured exactly on the simulator.

The numbers are worked out by hand from the shapes below, with swap-core's
packing rules: inside a packed host buffer every state starts on a 64-byte
boundary (16 fp32 or 32 bf16 elements); a batch moves as one copy per dtype
into a staging arena whose per-dtype regions are rounded up to 512 bytes; two
arenas alternate, the even batches in one and the odd in the other, each as large
as the largest batch it stages. The peak is the two arenas together, on the first
step (states born in host memory) exactly as on later ones.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

pytestmark = pytest.mark.sim_only

# Parameters: fp32 (1000,), bf16 (1000,), fp32 (1000,), bf16 (1000,).
DTYPES = (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)
NUMEL = 1000

# amsgrad=False, swap_times=2. Swapped bytes per parameter: 2 states x 1000 x 4 = 8000 (fp32) or
# 2 x 1000 x 2 = 4000 (bf16); total 24000, so the balanced cut is after parameter 1: batches [p0, p1], [p2, p3].
# fp32 region of a batch: exp_avg at element 0, exp_avg_sq at align16(1000) = 1008, end 2008 -> 8032 B -> 8192.
# bf16 region of a batch: exp_avg at 0, exp_avg_sq at align32(1000) = 1024, end 2024 -> 4048 B -> 4096.
# Two arenas: 2 x (8192 + 4096) = 24576 bytes. Per-tensor: two batches of 8000 + 4000 = 24000 bytes.
# amsgrad=True, swap_times=4 (one parameter per batch):
# fp32: states at 0, 1008, 2016, end 3016 -> 12064 B -> 12288. bf16: 0, 1024, 2048, end 3048 -> 6096 B -> 6144.
# Each batch holds one dtype; the even batches (fp32) share one arena, the odd ones (bf16) the other, each as large
# as the largest batch it stages: 12288 + 6144 = 18432 bytes. Per-tensor: 12000 + 6000 = 18000 bytes.
EXPECTED_PEAK = {
    (False, 2, True): 2 * (8192 + 4096),
    (False, 2, False): 2 * (8000 + 4000),
    (True, 4, True): 12288 + 6144,
    (True, 4, False): 12000 + 6000,
}


def _params(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(NUMEL, generator=generator).to(dtype)) for dtype in DTYPES]


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)


@pytest.mark.parametrize(("amsgrad", "swap_times", "packed"), list(EXPECTED_PEAK))
def test_first_step_peak_equals_steady_state_peak_and_the_bound(amsgrad: bool, swap_times: int, packed: bool) -> None:
    sim = SimBackend(mode="lazy")
    params = _params()
    config = SwapConfig(backend=sim, swap_times=swap_times, packed=packed, min_numel=64)
    optimizer = swap_optimizer(torch.optim.Adam(params, lr=1e-2, amsgrad=amsgrad), config)
    expected = EXPECTED_PEAK[(amsgrad, swap_times, packed)]
    peaks = []
    for step in range(4):
        _set_grads(params, step)
        assert sim.memory_allocated() == 0, "swapped state must hold no device bytes between steps"
        sim.reset_peak_memory_stats()
        optimizer.step()
        sim.synchronize()
        peaks.append(sim.max_memory_allocated())
        assert optimizer.stats.peak_state_device_bytes == expected
        assert optimizer.stats.resident_state_device_bytes == 0
    assert peaks == [expected] * 4
    assert sim.memory_allocated() == 0


@pytest.mark.parametrize("swap_times", [1, 3])
def test_mixed_dtypes_use_one_packed_buffer_and_one_copy_per_dtype_per_batch(swap_times: int) -> None:
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    sim = SimBackend(mode="lazy")
    generator = torch.Generator().manual_seed(0)
    # 9 parameters of 300 elements, dtypes cycling, so each batch of 3 holds all three dtypes.
    params = [torch.nn.Parameter(torch.randn(300, generator=generator).to(dtypes[i % 3])) for i in range(9)]
    optimizer = swap_optimizer(
        torch.optim.AdamW(params, lr=1e-2, amsgrad=True), SwapConfig(backend=sim, swap_times=swap_times, min_numel=64)
    )
    for step in range(3):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        sim.reset_copy_stats()
        optimizer.step()
        sim.synchronize()
        # 27 states of 3 dtypes: one copy per dtype per batch each way, not one per state.
        assert sim.copy_stats.h2d_copies == sim.copy_stats.d2h_copies == 3 * swap_times
        assert optimizer.stats.batches == swap_times
    assert optimizer.host_layout().packed_dtypes == set(dtypes)


def test_states_existing_before_wrapping_move_to_host_memory() -> None:
    sim = SimBackend(mode="random", seed=5)
    params, reference_params = _params(), _params()
    plain = torch.optim.Adam(params, lr=1e-2, amsgrad=True)
    reference = torch.optim.Adam(reference_params, lr=1e-2, amsgrad=True)
    for step in range(2):
        for group in (params, reference_params):
            _set_grads(group, step)
        plain.step()
        reference.step()
    moments = [plain.state[param]["exp_avg"] for param in params]
    optimizer = swap_optimizer(plain, SwapConfig(backend=sim, swap_times=2, min_numel=64))
    optimizer.synchronize()
    for param, old in zip(params, moments, strict=True):
        state: dict[str, Any] = optimizer.state[param]
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert not sim.owns(state[key]), f"{key} should live in host memory after wrapping"
        assert_bitwise_equal(old, state["exp_avg"], "exp_avg carried into host memory")
    assert sim.memory_allocated() == 0
    for step in range(2, 6):
        for group in (params, reference_params):
            _set_grads(group, step)
        optimizer.step()
        reference.step()
        for index, (expected, actual) in enumerate(zip(reference_params, params, strict=True)):
            assert_bitwise_equal(expected, actual, f"step {step}: parameter {index}")
    assert_state_dicts_equal(reference.state_dict(), optimizer.state_dict(), "after wrapping a stepped Adam")
