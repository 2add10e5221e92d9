"""Inputs swapped Adam refuses: the error a user sees, and an optimizer state left as it was.

Options swapping cannot support and Adam subclasses whose math the adapter does
not know are refused at wrap time with :class:`UnsupportedOptimizerError`
(before any state moves); errors torch itself raises stay torch's own.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.errors import StateDictMismatchError, UnsupportedOptimizerError
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

pytestmark = pytest.mark.sim_only

SHAPES = ((40, 30), (90,), (25, 20))


def _params(shapes: tuple[tuple[int, ...], ...] = SHAPES, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    generator = torch.Generator().manual_seed(500 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator, dtype=torch.float32).to(param.dtype)


def _config(**overrides: Any) -> SwapConfig:
    options: dict[str, Any] = {"backend": SimBackend(mode="random", seed=1), "swap_times": 2, "min_numel": 64}
    options.update(overrides)
    return SwapConfig(**options)


def _stepped(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], steps: int = 2) -> None:
    for step in range(steps):
        _set_grads(params, step)
        optimizer.step()


def _snapshot(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(optimizer.state_dict())


class LoggingAdam(torch.optim.Adam):
    """Overrides step: swapping would silently skip whatever it adds."""

    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


class CustomInitAdam(torch.optim.AdamW):
    def _init_group(self, *args: Any, **kwargs: Any) -> Any:
        return super()._init_group(*args, **kwargs)


class RenamedAdam(torch.optim.Adam):
    """A subclass that only changes construction: served by the Adam adapter through the registry."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=3e-3, amsgrad=True)


@pytest.mark.parametrize(("optimizer_cls", "method"), [(LoggingAdam, "step"), (CustomInitAdam, "_init_group")])
def test_subclass_overriding_the_step_math_is_refused_with_its_state_untouched(
    optimizer_cls: type[torch.optim.Adam], method: str
) -> None:
    params = _params()
    optimizer = optimizer_cls(params, lr=1e-2)
    _stepped(optimizer, params)
    before = _snapshot(optimizer)
    tensors = {id(value) for state in optimizer.state.values() for value in state.values()}
    with pytest.raises(UnsupportedOptimizerError) as raised:
        swap_optimizer(optimizer, _config())
    message = str(raised.value)
    assert f"{optimizer_cls.__qualname__} overrides {method}" in message
    assert f"swap_core.register_adapter({optimizer_cls.__name__}, factory, name=...)" in message
    assert {id(value) for state in optimizer.state.values() for value in state.values()} == tensors
    assert_state_dicts_equal(before, optimizer.state_dict(), "state after a refused wrap")
    _stepped(optimizer, params, 1)  # the plain optimizer still works


def test_subclass_with_only_a_new_constructor_is_swapped_exactly() -> None:
    params, reference_params = _params(), _params()
    reference = RenamedAdam(reference_params)
    optimizer = swap_optimizer(RenamedAdam(params), _config())
    for step in range(4):
        _set_grads(params, step)
        _set_grads(reference_params, step)
        optimizer.step()
        reference.step()
    for index, (expected, actual) in enumerate(zip(reference_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert_state_dicts_equal(reference.state_dict(), optimizer.state_dict(), "RenamedAdam")


def test_state_keys_adam_does_not_create_are_refused_with_the_state_untouched() -> None:
    params = _params()
    optimizer = torch.optim.Adam(params, lr=1e-2)
    _stepped(optimizer, params)
    optimizer.state[params[1]]["ema"] = torch.zeros_like(params[1])
    optimizer.state[params[2]]["slow_weights"] = torch.zeros_like(params[2])
    before = _snapshot(optimizer)
    with pytest.raises(UnsupportedOptimizerError) as raised:
        swap_optimizer(optimizer, _config())
    message = str(raised.value)
    assert "state keys ['ema', 'slow_weights']" in message
    assert "swap_core.register_adapter(Adam, factory, name=...)" in message
    assert_state_dicts_equal(before, optimizer.state_dict(), "state after a refused wrap")


def test_differentiable_is_refused_naming_the_option_and_the_group() -> None:
    params = _params()
    groups = [{"params": params[:1]}, {"params": params[1:], "differentiable": True}]
    with pytest.raises(UnsupportedOptimizerError, match=r"Adam with differentiable=True in param group 1 cannot be"):
        swap_optimizer(torch.optim.Adam(groups, lr=1e-2), _config())


def test_differentiable_group_added_later_is_refused_at_its_first_step() -> None:
    params = _params()
    optimizer = swap_optimizer(torch.optim.AdamW(params[:2], lr=1e-2), _config())
    _stepped(optimizer, params[:2])
    before = _snapshot(optimizer)
    optimizer.add_param_group({"params": params[2:], "differentiable": True})
    _set_grads(params, 5)
    with pytest.raises(UnsupportedOptimizerError, match=r"AdamW with differentiable=True in param group 1"):
        optimizer.step()
    # Refused before its first state was created; the earlier group's states are as they were.
    assert not optimizer.state.get(params[2])
    after = {key: value for key, value in optimizer.state_dict()["state"].items() if value}
    assert_state_dicts_equal(
        {"state": before["state"], "param_groups": []}, {"state": after, "param_groups": []}, "earlier group"
    )


def test_sparse_gradient_raises_and_leaves_the_state_untouched() -> None:
    params = _params()
    optimizer = swap_optimizer(torch.optim.Adam(params, lr=1e-2), _config())
    _stepped(optimizer, params)
    before_state = _snapshot(optimizer)
    before_params = [param.detach().clone() for param in params]
    _set_grads(params, 9)
    params[1].grad = params[1].grad.to_sparse()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"Parameter \(90,\) of param group 0 has a sparse gradient"):
        optimizer.step()
    assert_state_dicts_equal(before_state, optimizer.state_dict(), "state after a sparse gradient")
    for index, (expected, actual) in enumerate(zip(before_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} after a sparse gradient")


def test_state_dict_with_mismatched_shapes_is_refused_with_the_state_untouched() -> None:
    source_params = _params(((40, 30), (91,), (25, 20)))
    source = torch.optim.Adam(source_params, lr=1e-2)
    _stepped(source, source_params)
    params, reference_params = _params(), _params()
    optimizer = swap_optimizer(torch.optim.Adam(params, lr=1e-2), _config())
    reference = torch.optim.Adam(reference_params, lr=1e-2)
    _stepped(optimizer, params)
    _stepped(reference, reference_params)
    before = _snapshot(optimizer)
    with pytest.raises(StateDictMismatchError) as raised:
        optimizer.load_state_dict(source.state_dict())
    assert "parameter 1 has 'exp_avg' of shape (91,), but the parameter needs (90,)" in str(raised.value)
    assert_state_dicts_equal(before, optimizer.state_dict(), "state after a refused load")
    # Still exact afterwards.
    for step in range(2, 4):
        _set_grads(params, step)
        _set_grads(reference_params, step)
        optimizer.step()
        reference.step()
    assert_state_dicts_equal(reference.state_dict(), optimizer.state_dict(), "steps after a refused load")


def _torch_error(run: Any) -> BaseException:
    with pytest.raises(BaseException) as raised:
        run()
    return raised.value


@pytest.mark.parametrize(
    "group_options",
    [
        {"lr": torch.tensor(1e-2), "foreach": True},  # torch: a tensor lr needs capturable with foreach
        {"capturable": True},  # torch: capturable single-tensor/foreach Adam needs an accelerator
    ],
    ids=["tensor_lr_foreach", "capturable_on_cpu"],
)
def test_errors_torch_raises_stay_torchs(group_options: dict[str, Any]) -> None:
    """Groups added after construction bypass the constructor's checks; the step raises what torch raises."""

    def failing_step(swapped: bool) -> BaseException:
        params = _params()
        optimizer: torch.optim.Optimizer = torch.optim.Adam(params[:2], lr=1e-2)
        if swapped:
            optimizer = swap_optimizer(optimizer, _config())
        optimizer.add_param_group({"params": params[2:], **group_options})
        _set_grads(params, 0)
        return _torch_error(optimizer.step)

    expected, actual = failing_step(False), failing_step(True)
    assert type(actual) is type(expected)
    assert str(actual) == str(expected)


def test_fused_with_complex_params_raises_torchs_error() -> None:
    def failing_step(swapped: bool) -> BaseException:
        param = torch.nn.Parameter(torch.randn(100, dtype=torch.complex64))
        optimizer: torch.optim.Optimizer = torch.optim.Adam([param], lr=1e-2, fused=True)
        if swapped:
            optimizer = swap_optimizer(optimizer, _config())
        param.grad = torch.randn(100, dtype=torch.complex64)
        return _torch_error(optimizer.step)

    expected, actual = failing_step(False), failing_step(True)
    assert type(actual) is type(expected) is RuntimeError
    assert str(actual) == str(expected)
    assert "`fused=True` requires all the params to be floating point Tensors" in str(actual)


def test_the_optimizer_keeps_working_after_torchs_fused_dtype_error() -> None:
    """After torch refuses a complex parameter of a fused group, the next step works, as torch's does."""

    def run(swapped: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        generator = torch.Generator().manual_seed(0)
        real = torch.nn.Parameter(torch.randn(100, generator=generator))
        complex_param = torch.nn.Parameter(torch.randn(100, dtype=torch.complex64, generator=generator))
        optimizer: torch.optim.Optimizer = torch.optim.Adam([real, complex_param], lr=1e-2, fused=True)
        if swapped:
            optimizer = swap_optimizer(optimizer, _config(min_numel=1))
        real.grad = torch.randn(100, generator=generator)
        complex_param.grad = torch.randn(100, dtype=torch.complex64, generator=generator)
        with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point"):
            optimizer.step()
        complex_param.grad = None
        optimizer.step()
        return real, optimizer.state_dict()["state"][0]

    (expected_param, expected_state), (param, state) = run(False), run(True)
    assert_bitwise_equal(expected_param, param, "parameter stepped after the error")
    assert float(state["step"]) == 1.0
    assert_state_dicts_equal(
        {"state": {0: expected_state}, "param_groups": []}, {"state": {0: state}, "param_groups": []}, "its state"
    )
