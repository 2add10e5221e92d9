"""swap_core.testing.views: a step's batches and the simulator behind an optimizer, read without private names."""

from __future__ import annotations

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend
from swap_core.testing.views import planned_batches, planned_resident_params, simulator_of

SHAPES = [(32, 40), (40,), (24, 24), (8,), (30, 30)]
"""(40,) and (8,) are under min_numel=64: their states stay resident (updated first, in no batch, copied by none)."""


def _params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_planned_batches_are_the_copies_the_simulator_counts(packed: bool) -> None:
    params = _params()
    sim = SimBackend()
    config = SwapConfig(backend=sim, swap_times=2, min_numel=64, packed=packed)
    optimizer = swap_optimizer(torch.optim.RMSprop(params, lr=1e-2, momentum=0.5), config)
    _step(params, optimizer)  # creates the states
    batches = planned_batches(optimizer)

    resident = planned_resident_params(optimizer)
    assert [id(param) for param in resident] == [id(params[1]), id(params[3])]
    swapped_in_order = [id(param) for param in params if param.numel() >= 64]
    assert [id(param) for batch in batches for param in batch.params] == swapped_in_order
    assert len(batches) == 2
    for batch in batches:
        swapped = [param for param in batch.params if param.numel() >= 64]
        keys = ("square_avg", "momentum_buffer")
        assert {(id(state.param), state.key) for state in batch.states} == {
            (id(param), key) for param in swapped for key in keys
        }
        assert all(state.nbytes == state.param.numel() * 4 and state.dtype == torch.float32 for state in batch.states)
        assert len(batch.copy_bytes) == (1 if packed else len(batch.states))
        assert sum(batch.copy_bytes) >= sum(state.nbytes for state in batch.states)

    assert simulator_of(optimizer) is simulator_of(sim) is sim
    sim.reset_copy_stats()
    _step(params, optimizer)
    sim.synchronize()
    assert sim.copy_stats.h2d_copies == sim.copy_stats.d2h_copies == sum(len(batch.copy_bytes) for batch in batches)
    assert sim.copy_stats.h2d_bytes == sim.copy_stats.d2h_bytes == sum(sum(batch.copy_bytes) for batch in batches)


def test_an_optimizer_over_cpu_parameters_has_no_plan_and_no_simulator() -> None:
    optimizer = swap_optimizer(torch.optim.RMSprop(_params(), lr=1e-2))
    with pytest.raises(ValueError, match="swaps nothing"):
        planned_batches(optimizer)
    with pytest.raises(TypeError, match=r"no backend .*SwapConfig\(backend=SimBackend"):
        simulator_of(optimizer)


def test_views_refuse_what_they_cannot_read() -> None:
    with pytest.raises(TypeError, match="takes a SwapOptimizer, got RMSprop"):
        planned_batches(torch.optim.RMSprop(_params(), lr=1e-2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"planned_resident_params\(\) takes a SwapOptimizer"):
        planned_resident_params(torch.optim.RMSprop(_params(), lr=1e-2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="runs on object"):
        simulator_of(object())  # type: ignore[arg-type]
