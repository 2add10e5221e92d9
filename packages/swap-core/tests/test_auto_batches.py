"""``swap_times="auto"``: batches sized from the device memory available, on a simulator with a capacity."""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.errors import DeviceMemoryError, SimOutOfMemoryError
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

pytestmark = pytest.mark.sim_only  # the capacity is the simulator's

SHAPES = ((64, 64), (64, 64), (128, 32), (4096,), (32, 32), (64, 48), (96, 40), (2048,))
MIB = 1 << 20
CAPACITIES = ((96, 2), (160, 2), (400, 2), (4096, 2), (160, 3), (400, 3), (4096, 3))
"""Device memory (KiB) and staging buffers of the auto checks."""


def _params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    generator = torch.Generator().manual_seed(7 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def _staging(stats_peak: int, stats_resident: int) -> int:
    return stats_peak - stats_resident


def test_the_simulated_device_refuses_an_allocation_beyond_its_capacity_after_giving_back_its_cache() -> None:
    sim = SimBackend(device_memory=MIB)
    assert sim.available_device_bytes() == MIB
    first = sim.empty((MIB // 8,), torch.float32)  # half of it
    assert sim.available_device_bytes() == MIB // 2
    with pytest.raises(torch.OutOfMemoryError, match=r"tried to allocate 1048576 bytes with 524288 of 1048576"):
        sim.empty((MIB // 4,), torch.float32)
    del first  # back to the cache: reserved, but a new allocation may have it
    assert sim.memory_reserved() == MIB // 2 and sim.available_device_bytes() == MIB
    whole = sim.empty((MIB // 4,), torch.float32)
    assert sim.memory_allocated() == MIB and sim.memory_reserved() == MIB, "the cache was given back first"
    assert isinstance(SimOutOfMemoryError("x"), torch.OutOfMemoryError)
    del whole
    assert SimBackend().available_device_bytes() is None, "no capacity: unknown"


def _pair(sim: SimBackend, **options: object) -> tuple[list[torch.Tensor], torch.optim.Optimizer, list[torch.Tensor]]:
    reference_params, params = _params(), _params()
    reference = torch.optim.AdamW(reference_params, lr=1e-2)
    swapped = swap_optimizer(torch.optim.AdamW(params, lr=1e-2), SwapConfig(backend=sim, min_numel=64, **options))  # type: ignore[arg-type]
    return reference_params, reference, params, swapped  # type: ignore[return-value]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("capacity_kib,buffers", CAPACITIES, ids=[f"{kib}KiB-{n}staged" for kib, n in CAPACITIES])
def test_auto_takes_the_fewest_batches_that_fit_and_steps_bitwise(
    packed: bool, capacity_kib: int, buffers: int
) -> None:
    """Each count's staging as ``staging_buffers`` lays it out: three buffers need more batches in the same memory
    (in 96 KiB they fit nowhere: refused below)."""
    sim = SimBackend(mode="random", seed=1, device_memory=capacity_kib * 1024)
    options = {"packed": packed, "staging_buffers": buffers}
    reference_params, reference, params, swapped = _pair(sim, swap_times="auto", **options)
    for step in range(4):
        for values, optimizer in ((reference_params, reference), (params, swapped)):
            _set_grads(values, step)
            optimizer.step()
    for index, (expected, actual) in enumerate(zip(reference_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert_state_dicts_equal(reference.state_dict(), swapped.state_dict(), "after 4 steps")
    stats = swapped.stats
    budget = int(0.8 * stats.available_device_bytes)
    staging = _staging(stats.peak_state_device_bytes, stats.resident_state_device_bytes)
    assert staging <= budget, f"{stats.batches} batches stage {staging} bytes over the budget of {budget}"
    assert sim.max_memory_reserved() <= sim.device_memory
    if stats.batches > 1:  # one batch fewer would not fit
        fewer = SimBackend(mode="sync", device_memory=sim.device_memory)
        _, _, fewer_params, one_less = _pair(fewer, swap_times=stats.batches - 1, **options)
        for step in range(2):
            _set_grads(fewer_params, step)
            one_less.step()
        assert _staging(one_less.stats.peak_state_device_bytes, one_less.stats.resident_state_device_bytes) > budget


def test_the_choice_follows_the_states_and_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    sim = SimBackend(mode="lazy", device_memory=160 * 1024)
    _, _, params, swapped = _pair(sim, swap_times="auto")
    with caplog.at_level(logging.INFO, logger="swap_core"):
        for step in range(3):
            _set_grads(params, step)
            swapped.step()
    said = [record.getMessage() for record in caplog.records if "swap_times='auto'" in record.getMessage()]
    assert len(said) == 1 and f"{swapped.stats.batches} batches" in said[0], said
    before = swapped.stats.batches
    extra = torch.nn.Parameter(torch.randn(128, 64))
    swapped.add_param_group({"params": [extra]})
    _set_grads([*params, extra], 3)
    swapped.step()
    assert swapped.stats.batches > before, "the states grew: the choice was made again, with more batches"


class _ShrinksAfterTheFirstLook(SimBackend):
    """A device whose free memory shrank right after the swap was first planned (another process took it)."""

    looked = False

    def available_device_bytes(self) -> int | None:
        available = super().available_device_bytes()
        if self.looked or available is None:
            return available
        self.looked = True
        return 4 * available


def test_an_out_of_memory_while_staging_replans_with_more_batches_once() -> None:
    """Packed: the arenas are allocated before any batch updates (per tensor, a later batch's staging is allocated
    after earlier ones updated: a failure there is a failed step, undone whole on a first step)."""
    sim = _ShrinksAfterTheFirstLook(mode="lazy", device_memory=200 * 1024)
    reference_params, reference, params, swapped = _pair(sim, swap_times="auto")
    sim.looked = False  # wrapping looked too: the first plan is the one that sees the memory that went
    for step in range(3):
        for values, optimizer in ((reference_params, reference), (params, swapped)):
            _set_grads(values, step)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                optimizer.step()
            if optimizer is swapped and step == 0:
                retry = [warning for warning in caught if issubclass(warning.category, ResourceWarning)]
                said = [str(warning.message) for warning in retry]
                assert said and "re-planned with" in said[0] and "Nothing was updated" in said[0], said
                assert retry[0].filename == __file__, f"the warning points at {retry[0].filename}, not the step"
    for index, (expected, actual) in enumerate(zip(reference_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} after the retried step")
    assert_state_dicts_equal(reference.state_dict(), swapped.state_dict(), "after the retried step")


@pytest.mark.parametrize(
    "capacity_kib,buffers,remedy",
    [(8, 2, "use more devices$"), (96, 3, r"stage fewer batches at a time \(staging_buffers=2 instead of 3\)")],
)
def test_nothing_that_fits_is_refused_before_anything_changes(capacity_kib: int, buffers: int, remedy: str) -> None:
    sim = SimBackend(mode="lazy", device_memory=capacity_kib * 1024)
    _, _, params, swapped = _pair(sim, swap_times="auto", staging_buffers=buffers)
    before = [param.detach().clone() for param in params]
    _set_grads(params, 0)
    with pytest.raises(
        DeviceMemoryError, match=r"even \d+ batches .* need \d+ bytes .* device_memory_fraction"
    ) as info:
        swapped.step()
    assert re.search(remedy, str(info.value)), str(info.value)
    for index, (expected, actual) in enumerate(zip(before, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert not any(swapped.state.get(param) for param in params)


def test_auto_needs_a_backend_that_reports_its_memory() -> None:
    with pytest.raises(ValueError, match=r"SimBackend\(device_memory=...\)"):
        swap_optimizer(torch.optim.AdamW(_params()), SwapConfig(backend=SimBackend(), swap_times="auto"))


@pytest.mark.parametrize(
    "options,error,words",
    [
        ({"swap_times": "Auto"}, TypeError, "SwapConfig.swap_times must be an int, got 'Auto'"),
        ({"device_memory_fraction": 0.0}, ValueError, r"device_memory_fraction: 0.0 \(must be within \(0, 1\]\)"),
        ({"device_memory_fraction": 1.5}, ValueError, "device_memory_fraction: 1.5"),
    ],
)
def test_bad_auto_settings_name_the_value(options: dict[str, object], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        SwapConfig(**options)  # type: ignore[arg-type]


class _AlwaysOverReporting(SimBackend):
    """A device that always says it has ten times the memory it has: the retry runs out of memory too."""

    def available_device_bytes(self) -> int | None:
        available = super().available_device_bytes()
        return None if available is None else 10 * available


def test_a_second_out_of_memory_is_a_clear_error_with_nothing_updated() -> None:
    sim = _AlwaysOverReporting(mode="lazy", device_memory=100 * 1024)
    _, _, params, swapped = _pair(sim, swap_times="auto")
    before = [param.detach().clone() for param in params]
    _set_grads(params, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        with pytest.raises(DeviceMemoryError, match=r"ran out of memory again with \d+ batches .* Nothing was updated"):
            swapped.step()
    for index, (expected, actual) in enumerate(zip(before, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert not any(swapped.state.get(param) for param in params), "the failed first step is undone"


# -- inside the backward ------------------------------------------------------------
def _backward_grads(params: list[torch.Tensor], step: int) -> None:
    """:func:`_set_grads`' gradients through a backward, whose hooks update the batches with
    ``SwapConfig(step="in_backward")`` (the last parameter's gradient final first)."""
    generator = torch.Generator().manual_seed(7 + step)
    grads = [torch.randn(param.shape, generator=generator) for param in params]
    for param in params:
        param.grad = None
    torch.autograd.backward([param.view_as(param) for param in params], grads)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_auto_inside_the_backward_takes_the_fewest_batches_that_fit_and_steps_bitwise(packed: bool) -> None:
    sim = SimBackend(mode="random", seed=2, device_memory=160 * 1024)
    reference_params, reference, params, swapped = _pair(sim, swap_times="auto", packed=packed, step="in_backward")
    for step in range(4):
        _set_grads(reference_params, step)
        reference.step()
        _backward_grads(params, step)
        swapped.step()
        stats = swapped.stats
        if step > 0:  # the first step creates the states after the backward
            assert stats.batches > 1 and stats.batches_in_backward == stats.batches, stats
    for index, (expected, actual) in enumerate(zip(reference_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert_state_dicts_equal(reference.state_dict(), swapped.state_dict(), "after 4 steps")
    staging = _staging(stats.peak_state_device_bytes, stats.resident_state_device_bytes)
    assert stats.available_device_bytes is not None and staging <= int(0.8 * stats.available_device_bytes)


def test_an_out_of_memory_staging_inside_the_backward_replans_with_more_batches_once() -> None:
    """A plan made inside the backward (a load is taken in at its first hook) on a device that claimed more memory
    than it had: its staging runs out of memory before any batch updated, so the hook re-plans with twice the
    batches and the backward goes on, every batch updated in it."""
    sim = _ShrinksAfterTheFirstLook(mode="lazy", device_memory=200 * 1024)
    reference_params, reference, params, swapped = _pair(sim, swap_times="auto", step="in_backward")
    for step in range(4):
        _set_grads(reference_params, step)
        reference.step()
        if step == 2:
            swapped.load_state_dict(swapped.state_dict())  # re-planned at the next backward's first hook
            sim.looked = False  # which sees four times the memory there is
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _backward_grads(params, step)
        retry = [warning for warning in caught if issubclass(warning.category, ResourceWarning)]
        if step == 2:
            said = [str(warning.message) for warning in retry]
            assert len(said) == 1 and "re-planned with" in said[0] and "Nothing was updated" in said[0], said
            assert retry[0].filename == __file__, f"the warning points at {retry[0].filename}, not the backward"
        else:
            assert not retry, [str(warning.message) for warning in retry]
        swapped.step()
        if step > 0:
            assert swapped.stats.batches_in_backward == swapped.stats.batches, swapped.stats
    for index, (expected, actual) in enumerate(zip(reference_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} after the retried step")
    assert_state_dicts_equal(reference.state_dict(), swapped.state_dict(), "after the retried step")


def test_a_second_out_of_memory_inside_the_backward_is_a_clear_error_with_nothing_updated() -> None:
    """The retry inside the backward runs out of memory too: the backward raises it, and nothing was updated."""
    sim = _AlwaysOverReporting(mode="lazy", device_memory=1 << 30)
    _, _, params, swapped = _pair(sim, swap_times="auto", step="in_backward")
    _backward_grads(params, 0)
    swapped.step()  # the states, after the backward
    sim.device_memory = 100 * 1024  # another process took the rest
    swapped.load_state_dict(swapped.state_dict())
    before = _snapshot_of(params, swapped)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        with pytest.raises(DeviceMemoryError, match=r"ran out of memory again with \d+ batches .* Nothing was updated"):
            _backward_grads(params, 1)
    after = _snapshot_of(params, swapped)
    for index, (expected, actual) in enumerate(zip(before, after, strict=True)):
        assert_bitwise_equal(expected, actual, f"tensor {index}")


def _snapshot_of(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters and every state tensor, copied (reading the state waits for the copies in flight)."""
    states = [value for param in params for value in optimizer.state[param].values() if torch.is_tensor(value)]
    return [tensor.detach().clone() for tensor in (*params, *states)]


# -- a retry that finds the memory the failed attempt held given back ----------------------
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("step_mode", ["after_backward", "in_backward"])
def test_a_retry_sees_the_memory_the_failed_staging_took_given_back(packed: bool, step_mode: str) -> None:
    """Another allocation leaves room for the first staging arena (or batch) but not for the next: the staging fails
    part-way, and the retry plans with the device memory free before it began (the part staged before the failure
    given back), so it finds the fewest batches that fit and the steps stay bitwise the plain optimizer's."""
    sim = SimBackend(mode="lazy", device_memory=250 * 1024)
    reference_params, reference, params, swapped = _pair(sim, swap_times="auto", packed=packed, step=step_mode)
    hog = None
    for step in range(4):
        _set_grads(reference_params, step)
        reference.step()
        if step == 2:  # the plan is current: this step's staging is the first to meet the hog
            plan = swapped.swap_plan()
            assert len(plan.batches) >= 3, "two batches are staged at a time: the second does not fit"
            free = sim.available_device_bytes()
            assert free is not None
            hog = sim.empty(((free - plan.peak_staging_bytes * 3 // 5) // 4,), torch.float32)
            free_with_hog = sim.available_device_bytes()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if step_mode == "in_backward":
                _backward_grads(params, step)
            else:
                _set_grads(params, step)
            swapped.step()
        retried = [str(warning.message) for warning in caught if issubclass(warning.category, ResourceWarning)]
        assert len(retried) == (step == 2), retried
        if step == 2:
            assert swapped.stats.available_device_bytes == free_with_hog, "the retry saw the failed staging held"
            if step_mode == "in_backward":
                assert swapped.stats.batches_in_backward == swapped.stats.batches
    assert hog is not None
    for index, (expected, actual) in enumerate(zip(reference_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} after the retried step")
    assert_state_dicts_equal(reference.state_dict(), swapped.state_dict(), "after the retried step")


@pytest.mark.parametrize("step_mode", ["after_backward", "in_backward"])
def test_a_step_refused_while_planning_leaves_a_new_group_without_state(step_mode: str) -> None:
    """``add_param_group`` with a parameter whose staging fits nowhere: the step is refused while planning, before
    anything changes, and the new parameter has no state afterwards (no zero state made for it), as the optimizer
    that never stepped it; once it fits (a larger device), the steps are bitwise the plain optimizer's."""
    sim = SimBackend(mode="lazy", device_memory=250 * 1024)
    reference_params, reference, params, swapped = _pair(sim, swap_times="auto", step=step_mode)
    _set_grads(reference_params, 0)
    reference.step()
    _set_grads(params, 0)
    swapped.step()
    extra_reference, extra = (
        torch.nn.Parameter(torch.randn(256, 256, generator=torch.Generator().manual_seed(3))) for _ in range(2)
    )
    reference.add_param_group({"params": [extra_reference]})
    swapped.add_param_group({"params": [extra]})
    before = _snapshot_of([*params, extra], swapped)
    _set_grads([*params, extra], 1)
    with pytest.raises(DeviceMemoryError, match=r"even \d+ batches"):
        swapped.step()
    assert extra not in swapped.state or not swapped.state[extra], "a refused step made a state"
    assert_state_dicts_equal(swapped.state_dict(), {**reference.state_dict()}, "after the refused step")
    for index, (expected, actual) in enumerate(zip(before, _snapshot_of([*params, extra], swapped), strict=True)):
        assert_bitwise_equal(expected, actual, f"tensor {index} after the refused step")
    sim.device_memory = 4 * MIB
    for step in range(1, 3):
        _set_grads([*reference_params, extra_reference], step)
        reference.step()
        _set_grads([*params, extra], step)
        swapped.step()
    for index, (expected, actual) in enumerate(
        zip([*reference_params, extra_reference], [*params, extra], strict=True)
    ):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert_state_dicts_equal(reference.state_dict(), swapped.state_dict(), "after the steps that fit")
