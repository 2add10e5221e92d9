"""swap-core's own conformance rows: RMSprop, the adapter swap-core ships."""

import pytest
import torch

from swap_core.sim import SimBackend
from swap_core.testing.conformance import (
    ConformanceCase,
    check_checkpoint_round_trip,
    check_fault,
    fault_points,
    make_conformance_tests,
)

CASES = [
    ConformanceCase("rmsprop", lambda groups: torch.optim.RMSprop(groups, lr=1e-2)),
    ConformanceCase(
        "rmsprop_centered_momentum_groups",
        lambda groups: torch.optim.RMSprop(groups, lr=1e-2, momentum=0.9, centered=True, weight_decay=0.1),
        group_options=({}, {"lr": 3e-3, "maximize": True, "foreach": True}),
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
    ),
]

globals().update(make_conformance_tests(CASES))


@pytest.mark.sim_only
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("step", ["after_backward", "in_backward"])
def test_three_staging_buffers_lose_nothing_at_any_failure_and_checkpoint_both_ways(packed: bool, step: str) -> None:
    """With ``staging_buffers=3`` three batches are on the device at once: a failure at every update and copy of a
    step leaves each parameter untouched or exactly stepped, and checkpoints go both ways (the families' rows run
    these with two; their parity and accounting rows run three too)."""
    case = CASES[1]  # three dtypes: packed copies cut at the arenas' middles
    options = {"packed": packed, "step": step, "staging_buffers": 3, "swap_times": 5}
    points = fault_points(case, SimBackend(mode="lazy"), **options)
    assert len({point.kind for point in points}) == 3, points
    for point in points:
        check_fault(case, SimBackend(mode="lazy"), point, **options)
    check_checkpoint_round_trip(case, SimBackend(mode="random", seed=3), **options)
