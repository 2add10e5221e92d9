"""Every Muon option combination against every swap layout, 20 steps each, bitwise.

The conformance rows run swap-core's whole suite on two configurations; this
sweep crosses the options ``Muon.step`` hands to the math (nesterov, weight
decay, both ``adjust_lr_fn`` values, fp32 and bf16) with ``swap_times`` 1, 3 and
8, packed and per-tensor. The simulator schedule rotates over lazy, sync and a
fresh random seed per test, so each (swap_times, layout) pair meets every kind
of schedule. Nine parameters: eight swapped, one (4x8) small enough to stay
resident, so ``swap_times=8`` really gives eight batches.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from swap_core.sim import SimMode
from swap_core.testing.conformance import ConformanceCase, check_parity
from swap_core.testing.pytest_plugin import BackendFactory

SWEEP_SHAPES = ((16, 24), (24, 16), (4, 8), (8, 12), (12, 8), (16, 16), (8, 20), (20, 8), (12, 12))
SWEEP_STEPS = 20


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    nesterov: bool
    weight_decay: float
    adjust_lr_fn: str
    dtype: torch.dtype
    swap_times: int
    packed: bool
    mode: SimMode
    seed: int

    def __str__(self) -> str:
        momentum = "nesterov" if self.nesterov else "heavy_ball"
        layout = "packed" if self.packed else "per_tensor"
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{momentum}-wd{self.weight_decay}-{self.adjust_lr_fn}-{dtype}-k{self.swap_times}-{layout}-"
            f"{self.mode}{self.seed}"
        )

    def case(self) -> ConformanceCase:
        def make_optimizer(groups: list[dict[str, object]]) -> torch.optim.Optimizer:
            return torch.optim.Muon(
                groups,
                lr=2e-2,
                nesterov=self.nesterov,
                weight_decay=self.weight_decay,
                adjust_lr_fn=self.adjust_lr_fn,
            )

        return ConformanceCase(str(self), make_optimizer, shapes=SWEEP_SHAPES, dtypes=(self.dtype,), steps=SWEEP_STEPS)


def sweep_points() -> list[SweepPoint]:
    points = []
    combinations = itertools.product(
        (True, False),
        (0.0, 0.1),
        ("original", "match_rms_adamw"),
        (torch.float32, torch.bfloat16),
        (1, 3, 8),
        (True, False),
    )
    for index, (nesterov, weight_decay, adjust_lr_fn, dtype, swap_times, packed) in enumerate(combinations):
        # Six layouts per option combination, so index % 3 gives each layout every schedule kind.
        mode: SimMode = ("lazy", "sync", "random")[(index + index // 6) % 3]
        seed = index if mode == "random" else 0
        points.append(SweepPoint(nesterov, weight_decay, adjust_lr_fn, dtype, swap_times, packed, mode, seed))
    return points


SWEEP = sweep_points()


def test_sweep_covers_every_layout_under_every_schedule_kind() -> None:
    seen = {(point.swap_times, point.packed, point.mode) for point in SWEEP}
    assert len(seen) == 3 * 2 * 3
    assert len(SWEEP) == 2 * 2 * 2 * 2 * 3 * 2


@pytest.mark.parametrize("point", SWEEP, ids=str)
def test_muon_options_parity(point: SweepPoint, swap_backend_factory: BackendFactory) -> None:
    backend = swap_backend_factory(mode=point.mode, seed=point.seed)
    check_parity(point.case(), backend, swap_times=point.swap_times, packed=point.packed)
