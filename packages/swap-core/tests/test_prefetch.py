"""``SwapOptimizer.prefetch()``: the first batches' copy-ins issued before ``step()`` (one batch with two staging
buffers, ``k - 1`` with ``k``), bitwise the same, faster on the clock.

The numbers must not change (RMSprop, core's own family, against the plain optimizer, in every
simulator mode, packed and per tensor, with races checked), the copies must not be doubled, edits
between prefetch and step must be followed, and on the virtual clock a prefetch issued before a
modeled backward must take that copy off the step's critical path.
"""

from __future__ import annotations

import gc

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.errors import SimInjectedFault
from swap_core.sim import LinkModel, SimBackend
from swap_core.testing.compare import assert_bitwise_equal
from swap_core.testing.conformance import SIM_MODES

pytestmark = pytest.mark.sim_only

SHAPES = ((64, 32), (48,), (40, 40), (8,), (96, 16))
"""(8,) is under min_numel=16: its states stay resident."""


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _rmsprop(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(params, lr=1e-2, momentum=0.9, centered=True)


def _pair(
    sim: SimBackend, **options: object
) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, list[torch.nn.Parameter], SwapOptimizer]:
    plain_params, params = _params(), _params()
    config = SwapConfig(**{"backend": sim, "swap_times": 3, "min_numel": 16, **options})  # type: ignore[arg-type]
    return plain_params, _rmsprop(plain_params), params, swap_optimizer(_rmsprop(params), config)


def _grads(step: int, *param_sets: list[torch.nn.Parameter]) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(shape, generator=generator) for shape in SHAPES]
    for params in param_sets:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()


def _assert_same(
    plain: torch.optim.Optimizer,
    plain_params: list[torch.nn.Parameter],
    swapped: SwapOptimizer,
    params: list[torch.nn.Parameter],
    where: str,
) -> None:
    swapped.synchronize()
    for index, (expected, actual) in enumerate(zip(plain_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"{where}: parameter {index}")
        for key, value in plain.state[expected].items():
            assert_bitwise_equal(value, swapped.state[actual][key], f"{where}: {key!r} of parameter {index}")


@pytest.mark.parametrize("buffers", [2, 3], ids=["two_buffers", "three_buffers"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize(("mode", "seed"), SIM_MODES[:8], ids=[f"{m}{s}" for m, s in SIM_MODES[:8]])
def test_prefetch_then_step_is_bitwise_the_plain_optimizer(mode: str, seed: int, packed: bool, buffers: int) -> None:
    sim = SimBackend(mode=mode, seed=seed)  # type: ignore[arg-type]
    plain_params, plain, params, swapped = _pair(sim, packed=packed, staging_buffers=buffers, swap_times=4)
    for step in range(6):
        _grads(step, plain_params, params)
        swapped.prefetch()  # a no-op at step 0: the states are created by the first step
        swapped.prefetch()  # idempotent
        plain.step()
        swapped.step()
        _assert_same(plain, plain_params, swapped, params, f"{mode}{seed} step {step}")
    assert not sim.races, sim.races


@pytest.mark.parametrize("buffers", [2, 3], ids=["two_buffers", "three_buffers"])
def test_a_prefetched_batch_is_copied_once(buffers: int) -> None:
    copies = []
    for prefetching in (False, True):
        sim = SimBackend(mode="random", seed=1)
        _, _, params, swapped = _pair(sim, staging_buffers=buffers, swap_times=4)
        for step in range(3):
            _grads(step, params)
            if prefetching:
                swapped.prefetch()
            swapped.step()
        copies.append((swapped.stats.h2d_copies, swapped.stats.h2d_bytes, sim.copy_stats.h2d_copies))
    assert copies[0] == copies[1], copies


@pytest.mark.parametrize("buffers", [2, 3], ids=["two_buffers", "three_buffers"])
def test_edits_and_loads_between_prefetch_and_step_are_followed(buffers: int) -> None:
    sim = SimBackend(mode="lazy")
    plain_params, plain, params, swapped = _pair(sim, staging_buffers=buffers, swap_times=4)
    for step in range(2):
        _grads(step, plain_params, params)
        plain.step()
        swapped.step()
    # A reset state: the step drops the prefetch (its plan is stale) and starts that parameter afresh.
    swapped.prefetch()
    del swapped.state[params[0]]
    del plain.state[plain_params[0]]
    _grads(2, plain_params, params)
    plain.step()
    swapped.step()
    _assert_same(plain, plain_params, swapped, params, "after a reset between prefetch and step")
    # A load between prefetch and step: it waits for the copy, and the step runs on the loaded state.
    checkpoint = plain.state_dict()
    swapped.prefetch()
    swapped.load_state_dict(checkpoint)
    _grads(3, plain_params, params)
    plain.step()
    swapped.step()
    _assert_same(plain, plain_params, swapped, params, "after a load between prefetch and step")
    assert not sim.races, sim.races


@pytest.mark.parametrize(
    ("buffers", "batch"), [(2, 0), (3, 0), (3, 1)], ids=["two_buffers", "three_buffers_first", "three_buffers_second"]
)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_a_failed_prefetch_leaves_nothing_pending_and_the_step_runs(packed: bool, buffers: int, batch: int) -> None:
    """A copy-in of the prefetched batch ``batch`` fails to enqueue (per tensor: after one copy of it was issued):
    the batches before it, copied in, are dropped with it, their staging memory freed."""
    sim = SimBackend(mode="random", seed=4)
    plain_params, plain, params, swapped = _pair(sim, packed=packed, staging_buffers=buffers, swap_times=4)
    _grads(0, plain_params, params)
    plain.step()
    swapped.step()
    allocated = sim.memory_allocated()
    copies_before = sum(len(earlier.transfers) for earlier in swapped.swap_plan().batches[:batch])
    sim.fail_copy(copies_before + (0 if packed else 1), "h2d")
    with pytest.raises(SimInjectedFault):
        swapped.prefetch()
    sim.synchronize()
    assert sim.memory_allocated() == allocated, "the staging memory of the failed prefetch is freed"
    _grads(1, plain_params, params)
    plain.step()
    swapped.step()
    _assert_same(plain, plain_params, swapped, params, "after a failed prefetch")


def test_an_optimizer_collected_with_its_prefetch_in_flight_leaves_a_twin_unharmed() -> None:
    """``del opt; gc.collect()`` right after a prefetch of two batches (three buffers) that the lazy simulator has
    not run: the collection waits for the copy-ins, the simulator sees no race on the freed memory, and a twin on
    the same backend steps bitwise as the plain optimizer."""
    sim = SimBackend(mode="lazy")
    _, _, params, swapped = _pair(sim, staging_buffers=3, swap_times=4)
    _grads(0, params)
    swapped.step()
    swapped.prefetch()
    assert swapped.prefetched
    del swapped
    gc.collect()
    sim.synchronize()
    assert not sim.races, sim.races
    plain_params, plain, twin_params, twin = _pair(sim, staging_buffers=3, swap_times=4)
    for step in range(3):
        _grads(step, plain_params, twin_params)
        plain.step()
        twin.step()
        twin.prefetch()
    _assert_same(plain, plain_params, twin, twin_params, "a twin after the collection")
    assert not sim.races, sim.races


@pytest.mark.parametrize(("buffers", "prefetched"), [(2, 1), (3, 2), (4, 4), (5, 4)])
def test_the_prefetch_copies_in_as_many_batches_as_leave_room_for_the_next(buffers: int, prefetched: int) -> None:
    """With ``k`` staging buffers the prefetch copies in ``k - 1`` batches (the step copies the next one in while the
    first updates); with as many buffers as batches, all of them."""
    sim = SimBackend(mode="random", seed=2)
    _, _, params, swapped = _pair(sim, staging_buffers=buffers, swap_times=4)
    _grads(0, params)
    swapped.step()
    swapped.synchronize()
    batches = swapped.swap_plan().batches
    assert len(batches) == 4
    before = sim.copy_stats.h2d_bytes
    swapped.prefetch()
    assert sim.copy_stats.h2d_bytes - before == sum(batch.nbytes for batch in batches[:prefetched])


def test_prefetch_before_a_modeled_backward_takes_the_first_copy_off_the_step() -> None:
    """On the virtual clock: issued before 2 ms of modeled backward, batch 0's copy-in is done when step() starts."""
    link = LinkModel.preset("pcie4")
    times = {}
    for prefetching in (False, True):
        sim = SimBackend(mode="lazy", check_races=False, poison=False, timing=link)
        params = [torch.nn.Parameter(torch.randn(1 << 18)) for _ in range(8)]
        swapped = swap_optimizer(torch.optim.AdamW(params, lr=1e-3), SwapConfig(backend=sim, swap_times=4))
        for _ in range(2):
            for param in params:
                param.grad = torch.ones_like(param)
            sim.synchronize()
            if prefetching:
                swapped.prefetch()
            sim.model_compute(2e-3)  # the backward
            swapped.step()
        times[prefetching] = (swapped.stats.modeled_step_seconds, swapped.stats.modeled_transfer_seconds)
    first_copy = (8 * (1 << 18) * 8 / 4) / (link.h2d_gbps * 1e9)
    without, with_prefetch = times[False][0], times[True][0]
    assert without is not None and with_prefetch is not None
    assert without - with_prefetch == pytest.approx(first_copy, rel=0.05), times


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_a_prefetch_right_after_step_overlaps_the_steps_last_copy_out(packed: bool) -> None:
    """On the virtual clock: a prefetch issued as soon as ``step()`` returns waits only for the copy-out of its own
    batch (its host mirror), not for the step's last one, so it copies in while that one still copies out (the
    staging was released, and nothing else is shared). An extra wait for the last copy-out fails here."""
    sim = SimBackend(mode="lazy", check_races=True, timing=LinkModel.preset("pcie5-achievable"))
    params = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(6)]
    swapped = swap_optimizer(torch.optim.AdamW(params, lr=1e-3), SwapConfig(backend=sim, swap_times=3, packed=packed))
    for step in range(3):
        for param in params:
            param.grad = torch.full_like(param, 0.5 + step)
        swapped.step()
        last_copy_out_ends = sim.modeled_times()
        swapped.prefetch()
        after = sim.modeled_times()
        assert last_copy_out_ends is not None and after is not None and after.transfers_started is not None
        if step > 0:  # the first step creates the states: nothing to prefetch before it
            assert after.transfers_started < last_copy_out_ends.transfers, (step, last_copy_out_ends, after)
    swapped.step()
    assert not sim.races, sim.races
