"""MuonAdapter beyond the conformance rows: discovery, where momentum lives, lazy creation, bad input."""

from __future__ import annotations

import importlib.metadata
import re

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer, default_registry, swap_optimizer
from swap_core.sim import MemoryKind, SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_muon import MuonAdapter

SHAPES = ((16, 24), (24, 16), (4, 8), (8, 12), (12, 8), (16, 16), (8, 20), (20, 8), (12, 12))
RESIDENT_SHAPE = (4, 8)  # 32 elements: under min_numel=64, so its momentum stays on the device


def make_params(shapes: tuple[tuple[int, ...], ...] = SHAPES) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def set_grads(params: list[torch.nn.Parameter], step: int, skip: frozenset[int] = frozenset()) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for index, param in enumerate(params):
        grad = torch.randn(param.shape, generator=generator)
        param.grad = None if index in skip else grad


def swapped_muon(params: list[torch.nn.Parameter], **config: object) -> SwapOptimizer:
    options: dict[str, object] = {"backend": SimBackend(mode="random", seed=5), "swap_times": 3, "min_numel": 64}
    options.update(config)
    return swap_optimizer(torch.optim.Muon(params, lr=2e-2), SwapConfig(**options))  # type: ignore[arg-type]


# -- discovery ---------------------------------------------------------------------------
def test_entry_point_is_declared() -> None:
    entry_points = importlib.metadata.entry_points(group="swap_core.adapters")
    muon = [entry_point for entry_point in entry_points if entry_point.name == "muon"]
    assert [entry_point.value for entry_point in muon] == ["swap_muon:register"]


def test_swap_optimizer_finds_the_adapter_through_the_registry() -> None:
    assert default_registry.registered()["muon"] is torch.optim.Muon
    assert isinstance(swapped_muon(make_params()).adapter, MuonAdapter)


def test_a_muon_subclass_is_served_by_the_same_adapter() -> None:
    class ScheduledMuon(torch.optim.Muon):
        pass

    optimizer = swap_optimizer(ScheduledMuon(make_params(), lr=2e-2), SwapConfig(backend=SimBackend()))
    assert isinstance(optimizer.adapter, MuonAdapter)


# -- where momentum lives ------------------------------------------------------------------
def test_momentum_is_host_memory_between_steps_and_moves_once_each_way() -> None:
    params = make_params()
    optimizer = swapped_muon(params, packed=False, swap_times=8)
    backend = optimizer.backend
    assert isinstance(backend, SimBackend)
    for step in range(2):
        set_grads(params, step)
        optimizer.step()
    optimizer.synchronize()

    swapped = [param for param in params if tuple(param.shape) != RESIDENT_SHAPE]
    (resident,) = (param for param in params if tuple(param.shape) == RESIDENT_SHAPE)
    for param in swapped:
        assert backend.memory_kind(optimizer.state[param]["momentum_buffer"]) is MemoryKind.HOST
    assert backend.memory_kind(optimizer.state[resident]["momentum_buffer"]) is not MemoryKind.HOST
    # One momentum buffer the size of its parameter, copied in and out once per step; the
    # resident one never moves.
    momentum_bytes = sum(param.numel() * param.element_size() for param in swapped)
    stats = optimizer.stats
    assert stats.h2d_bytes == stats.d2h_bytes == momentum_bytes
    assert stats.h2d_copies == stats.d2h_copies == len(swapped)
    assert stats.batches == 8
    assert stats.resident_state_device_bytes == resident.numel() * resident.element_size()


def test_momentum_is_created_on_a_parameters_first_gradient_as_muon_does() -> None:
    reference_params, swapped_params = make_params(), make_params()
    reference = torch.optim.Muon(reference_params, lr=2e-2)
    swapped = swapped_muon(swapped_params)
    late = frozenset({1, 4})  # no gradient for the first two steps
    never = frozenset({7})
    for step in range(5):
        skip = late | never if step < 2 else never
        for params, optimizer in ((reference_params, reference), (swapped_params, swapped)):
            set_grads(params, step, skip)
            optimizer.step()
        expected, actual = reference.state_dict(), swapped.state_dict()
        assert sorted(actual["state"]) == sorted(expected["state"])
        assert_state_dicts_equal(expected, actual, f"step {step}")
    assert 7 not in swapped.state_dict()["state"]
    for index, (expected_param, actual_param) in enumerate(zip(reference_params, swapped_params, strict=True)):
        assert_bitwise_equal(expected_param, actual_param, f"parameter {index}")


# -- every option reaches the math --------------------------------------------------------
OPTION_VALUES = [
    ("lr", 7e-3),
    ("weight_decay", 0.3),
    ("momentum", 0.5),
    ("nesterov", False),
    ("ns_coefficients", (3.0, -3.2, 1.2)),
    ("ns_steps", 2),
    ("eps", 1e-3),  # matters only for a gradient norm under eps: the gradients below are tiny
    ("adjust_lr_fn", "match_rms_adamw"),
]


def run_muon(options: dict[str, object], swapped: bool) -> list[torch.nn.Parameter]:
    params = make_params()
    plain = torch.optim.Muon(params, **{"lr": 2e-2, **options})  # type: ignore[arg-type]
    optimizer = swap_optimizer(plain, SwapConfig(backend=SimBackend(mode="lazy"), min_numel=64)) if swapped else plain
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        for param in params:
            param.grad = 1e-7 * torch.randn(param.shape, generator=generator)
        optimizer.step()
    return params


@pytest.mark.parametrize(("option", "value"), OPTION_VALUES, ids=[name for name, _ in OPTION_VALUES])
def test_every_muon_option_reaches_the_math(option: str, value: object) -> None:
    default = run_muon({}, swapped=False)
    expected = run_muon({option: value}, swapped=False)
    assert any(not torch.equal(a, b) for a, b in zip(default, expected, strict=True)), f"{option} changes nothing here"
    actual = run_muon({option: value}, swapped=True)
    for index, (mine, theirs) in enumerate(zip(expected, actual, strict=True)):
        assert_bitwise_equal(mine, theirs, f"{option}={value!r}: parameter {index}")


# -- bad input -------------------------------------------------------------------------------
TORCH_NOT_2D = "Muon only supports 2D parameters whereas we found a parameter with size: torch.Size([64])"
TORCH_NOT_2D_GRAD = "Param gradient must be a 2D matrix"


def test_muon_refuses_non_2d_params_before_anything_is_wrapped() -> None:
    with pytest.raises(ValueError, match=re.escape(TORCH_NOT_2D)):
        torch.optim.Muon([torch.nn.Parameter(torch.randn(64))])


@pytest.mark.parametrize("shape", [(64,), (2, 4, 8)], ids=["1d", "3d"])
def test_a_non_2d_param_added_later_fails_the_step_exactly_as_in_plain_muon(shape: tuple[int, ...]) -> None:
    """``Muon.add_param_group`` does not check dimensions; the step raises torch's error, same state after."""
    reference_params, swapped_params = make_params(), make_params()
    reference = torch.optim.Muon(reference_params, lr=2e-2)
    swapped = swapped_muon(swapped_params)
    for params, optimizer in ((reference_params, reference), (swapped_params, swapped)):
        set_grads(params, 0)
        optimizer.step()
        odd = torch.nn.Parameter(torch.ones(shape))
        optimizer.add_param_group({"params": [odd]})
        params.append(odd)
        set_grads(params, 1)
        with pytest.raises(ValueError, match=re.escape(TORCH_NOT_2D_GRAD)):
            optimizer.step()
    assert_state_dicts_equal(reference.state_dict(), swapped.state_dict(), "after the failed step")
    for index, (expected, actual) in enumerate(zip(reference_params, swapped_params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} after the failed step")
    assert not swapped.backend.races  # type: ignore[union-attr]


@pytest.mark.parametrize("swapped", [False, True], ids=["plain", "swapped"])
def test_complex_params_keep_torchs_error_and_stay_untouched(swapped: bool) -> None:
    params = [torch.nn.Parameter(torch.randn(16, 24)), torch.nn.Parameter(torch.randn(8, 12, dtype=torch.complex64))]
    before = [param.detach().clone() for param in params]
    plain = torch.optim.Muon(params, lr=2e-2)
    optimizer = swap_optimizer(plain, SwapConfig(backend=SimBackend(), min_numel=0, swap_times=1)) if swapped else plain
    for param in params:
        param.grad = torch.randn_like(param)
    with pytest.raises(RuntimeError, match=r"^Muon does not support complex parameters$"):
        optimizer.step()
    for index, (expected, actual) in enumerate(zip(before, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
