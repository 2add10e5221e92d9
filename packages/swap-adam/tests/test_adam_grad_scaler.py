"""``torch.amp.GradScaler`` with a swapped Adam: scaled steps, skipped inf steps, bitwise as torch.

Fused Adam takes ``grad_scale``/``found_inf`` from the scaler (set on the
SwapOptimizer, forwarded to the wrapped optimizer during ``step``) and skips
inside the kernel; non-fused Adam is unscaled by ``scaler.unscale_`` and the
scaler skips ``step()`` itself. Both runs see the same scaled losses, so the
parameters, the states and the scale's trajectory must agree exactly.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

pytestmark = pytest.mark.sim_only

SHAPES = ((40, 30), (90,), (25, 20), (7,))
STEPS = 10
INF_STEPS = (2, 6)


def _train(
    optimizer_cls: type[torch.optim.Adam], fused: bool, clip: bool, backend: SimBackend | None
) -> tuple[list[torch.Tensor], dict[str, object], list[float]]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    optimizer: torch.optim.Optimizer = optimizer_cls(params, lr=1e-2, amsgrad=True, weight_decay=0.01, fused=fused)
    if backend is not None:
        optimizer = swap_optimizer(optimizer, SwapConfig(backend=backend, swap_times=3, min_numel=64))
    assert getattr(optimizer, "_step_supports_amp_scaling", False) is fused
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    scales = []
    for step in range(STEPS):
        weights = [torch.randn(param.shape, generator=generator) for param in params]
        if step in INF_STEPS:
            weights[1][5] = float("inf")
        loss = sum((param * weight).sum() for param, weight in zip(params, weights, strict=True))
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        if clip:  # the common pattern: unscale explicitly, clip, then step
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
        before = [param.detach().clone() for param in params]
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        if step in INF_STEPS:
            for index, (old, param) in enumerate(zip(before, params, strict=True)):
                assert_bitwise_equal(old, param, f"inf step {step} must not move parameter {index}")
    return params, optimizer.state_dict(), scales


@pytest.mark.parametrize("clip", [False, True], ids=["scaled", "unscale_clip"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("optimizer_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_grad_scaler_steps_and_skips_exactly_as_torch(
    optimizer_cls: type[torch.optim.Adam], fused: bool, clip: bool
) -> None:
    expected_params, expected_state, expected_scales = _train(optimizer_cls, fused, clip, None)
    params, state, scales = _train(optimizer_cls, fused, clip, SimBackend(mode="random", seed=11))
    assert scales == expected_scales
    moves = {(later > earlier) - (later < earlier) for earlier, later in itertools.pairwise(scales)}
    assert {-1, 1} <= moves, f"the scale should both back off and grow: {scales}"
    for index, (expected, actual) in enumerate(zip(expected_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert_state_dicts_equal(expected_state, state, "GradScaler run")
    steps = {float(entry["step"]) for entry in state["state"].values()}  # type: ignore[attr-defined]
    assert steps == {float(STEPS - len(INF_STEPS))}, "inf steps must not count"
