"""From ``opt.step()`` to the family's update of a packed AdamW batch is a short way (docs/architecture.md, "One
step, counted in frames"): every frame between them is one idea of the skeleton, and a new layer shows here."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend

FRAMES = 7
"""``SwapOptimizer.step``, the driver's ``step`` (the skeleton), the scheduler's ``end``, the walk's ``advance``,
the scheduler's ``update_batch``, the run's ``update``, the adapter's ``update``."""


def _frames_to_the_update(**options: Any) -> list[str]:
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(4)]
    optimizer = swap_optimizer(
        torch.optim.AdamW(params), SwapConfig(backend=SimBackend(), swap_times=2, min_numel=1, **options)
    )
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()  # the states
    seen: list[list[str]] = []
    update = optimizer.adapter.update

    def counted(batch: Any) -> None:
        stack = traceback.extract_stack()[:-1]  # this function stands for the adapter's update
        names = [f"{Path(frame.filename).name}:{frame.name}" for frame in stack]
        start = max(index for index, name in enumerate(names) if name == "swap_optimizer.py:step")
        seen.append([*names[start:], "the adapter's update"])
        update(batch)

    optimizer.adapter.update = counted  # type: ignore[method-assign]
    optimizer.step()
    return seen[0]


def test_a_packed_adamw_batch_is_updated_seven_frames_below_step() -> None:
    frames = _frames_to_the_update()
    assert len(frames) == FRAMES, frames
    assert frames[1] == "step_driver.py:step" and frames[-2] == "step_run.py:update", frames


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_per_tensor_staging_takes_the_same_way(packed: bool) -> None:
    assert len(_frames_to_the_update(packed=packed)) == FRAMES
