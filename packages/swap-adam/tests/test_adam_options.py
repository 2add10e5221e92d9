"""Adam behaviours beyond the conformance rows: complex parameters, groups added mid-training,
parameters without gradients, and torch's implementation choice made for the whole group."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.optim.optimizer as torch_optimizer

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

pytestmark = pytest.mark.sim_only


def _make(shapes_dtypes: list[tuple[tuple[int, ...], torch.dtype]], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape, dtype in shapes_dtypes:
        real_dtype = torch.float32 if dtype.is_complex else dtype
        values = torch.randn((*shape, 2) if dtype.is_complex else shape, generator=generator).to(real_dtype)
        params.append(torch.nn.Parameter(torch.view_as_complex(values) if dtype.is_complex else values))
    return params


def _grads(params: list[torch.Tensor], step: int, skip: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    generator = torch.Generator().manual_seed(700 + step)
    for index, param in enumerate(params):
        if param.is_complex():
            grad = torch.view_as_complex(torch.randn((*param.shape, 2), generator=generator))
        else:
            grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        param.grad = None if index in skip else grad


def _assert_params_equal(expected: list[torch.Tensor], actual: list[torch.Tensor], context: str) -> None:
    for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert_bitwise_equal(want, got, f"{context}: parameter {index}")


COMPLEX_LAYOUT = [((40, 30), torch.float32), ((50, 4), torch.complex64), ((90,), torch.float32)]


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_complex_params_keep_their_states_resident_and_exact(foreach: bool) -> None:
    sim = SimBackend(mode="random", seed=4)
    params, reference_params = _make(COMPLEX_LAYOUT), _make(COMPLEX_LAYOUT)
    options: dict[str, Any] = {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1, "foreach": foreach}
    reference = torch.optim.Adam(reference_params, **options)
    optimizer = swap_optimizer(torch.optim.Adam(params, **options), SwapConfig(backend=sim, swap_times=3, min_numel=64))
    for step in range(6):
        _grads(params, step)
        _grads(reference_params, step)
        optimizer.step()
        reference.step()
        _assert_params_equal(reference_params, params, f"step {step}")
    assert_state_dicts_equal(reference.state_dict(), optimizer.state_dict(), "complex parameters")
    layout = optimizer.host_layout()
    complex_param = params[1]
    assert not layout.swapped_keys(complex_param), "complex states cannot be swapped (not floating point)"
    assert sim.owns(optimizer.state[complex_param]["exp_avg"]), "complex states stay on the device"
    for real in (params[0], params[2]):
        assert layout.swapped_keys(real) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert optimizer.stats.resident_state_device_bytes == 3 * 200 * 8  # 3 complex64 states of 200 elements


def test_param_group_added_mid_training_is_swapped_exactly() -> None:
    sim = SimBackend(mode="random", seed=8)
    layout = [((40, 30), torch.float32), ((90,), torch.bfloat16), ((25, 20), torch.float32), ((80,), torch.float16)]
    params, reference_params = _make(layout), _make(layout)
    reference = torch.optim.AdamW(reference_params[:2], lr=1e-2)
    optimizer = swap_optimizer(
        torch.optim.AdamW(params[:2], lr=1e-2), SwapConfig(backend=sim, swap_times=2, min_numel=64)
    )
    new_group: dict[str, Any] = {"lr": torch.tensor(3e-3), "amsgrad": True, "maximize": True, "weight_decay": 0.2}
    for step in range(8):
        if step == 3:
            reference.add_param_group({"params": reference_params[2:], **new_group})
            optimizer.add_param_group({"params": params[2:], **new_group})
        active = 2 if step < 3 else 4
        _grads(params[:active], step)
        _grads(reference_params[:active], step)
        assert sim.memory_allocated() == 0
        optimizer.step()
        reference.step()
        _assert_params_equal(reference_params, params, f"step {step}")
    assert optimizer.host_layout().swapped_keys(params[3]) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert_state_dicts_equal(reference.state_dict(), optimizer.state_dict(), "after add_param_group")


def test_params_without_gradients_are_skipped_like_torch() -> None:
    layout = [((40, 30), torch.float32), ((90,), torch.float32), ((25, 20), torch.float32)]
    params, reference_params = _make(layout), _make(layout)
    reference = torch.optim.Adam(reference_params, lr=1e-2)
    optimizer = swap_optimizer(torch.optim.Adam(params, lr=1e-2), SwapConfig(backend="sim", swap_times=3))
    for step in range(6):
        # Parameter 0 never has a gradient; parameter 2 only from step 2 on.
        skip = {0} if step >= 2 else {0, 2}
        _grads(params, step, skip)
        _grads(reference_params, step, skip)
        optimizer.step()
        reference.step()
        _assert_params_equal(reference_params, params, f"step {step}")
    assert not optimizer.state.get(params[0])
    assert float(optimizer.state[params[2]]["step"]) == 4.0
    assert_state_dicts_equal(reference.state_dict(), optimizer.state_dict(), "grads None")


class MarkedParameter(torch.nn.Parameter):
    """A Parameter subclass: torch's default-implementation check rejects foreach for its whole group."""


@pytest.mark.parametrize("case", ["subclass_param", "tensor_lr"])
def test_default_implementation_is_torchs_choice_for_the_whole_group(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """With foreach=None torch decides once per group; a batch holding part of the group must not re-decide.

    The CPU is declared a foreach device, so torch's default would be foreach, except that
    ``subclass_param``: one parameter of the group is a Parameter subclass, which turns foreach
    off for the whole group, and ``tensor_lr``: a tensor lr keeps torch on single-tensor Adam.
    In fp16 the two implementations round differently, so a batch that re-decided would show
    (with a tensor lr, foreach Adam would raise).
    """
    monkeypatch.setattr(torch_optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    layout = [((300,), torch.float16)] * 4

    def build(swapped: bool) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        params = _make(layout)
        if case == "subclass_param":
            params[3] = MarkedParameter(params[3].detach())
        lr: float | torch.Tensor = torch.tensor(1e-2) if case == "tensor_lr" else 1e-2
        optimizer: torch.optim.Optimizer = torch.optim.Adam(params, lr=lr, weight_decay=0.1)
        if swapped:
            optimizer = swap_optimizer(optimizer, SwapConfig(backend=SimBackend(), swap_times=4, min_numel=64))
        return params, optimizer

    (reference_params, reference), (params, optimizer) = build(False), build(True)
    assert isinstance(optimizer, SwapOptimizer)
    for step in range(8):
        _grads(params, step)
        _grads(reference_params, step)
        optimizer.step()
        reference.step()
    _assert_params_equal(reference_params, params, "group-level implementation choice")
    # The premise: foreach and single-tensor Adam differ on these fp16 parameters.
    foreach_params, foreach = build(False)
    for group in foreach.param_groups:
        group["foreach"], group["lr"] = True, 1e-2
    single_params, single = build(False)
    for group in single.param_groups:
        group["foreach"], group["lr"] = False, 1e-2
    for step in range(8):
        _grads(foreach_params, step)
        _grads(single_params, step)
        foreach.step()
        single.step()
    assert not all(torch.equal(a, b) for a, b in zip(foreach_params[:3], single_params[:3], strict=True))
