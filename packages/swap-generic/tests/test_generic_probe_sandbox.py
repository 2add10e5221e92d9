"""The wrap-time probe runs in a sandbox: after a wrap, accepted or refused, the optimizer is a never-wrapped twin.

Each optimizer below is a small one written for these tests, standing for a class of real ones (not a copy of any).
The probe steps deep copies of the optimizer (attributes, ``defaults``, schedules) that share nothing mutable with it;
code it runs on planted inputs cannot end the program; an optimizer stepped only in train mode is probed in it; an
optimizer that delegates to inner optimizers is refused before anything is stepped.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from test_generic_probe import _config, _params, _PlainSGD

from swap_core import swap_optimizer
from swap_core.errors import UnsupportedOptimizerError
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal


class CountsInDefaults(_PlainSGD):
    """Counts its steps in ``defaults`` and warms its learning rate up by that count (refused: it counts per batch)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, lr)
        self.defaults["calls"] = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.defaults["calls"] += 1
        warmup = min(1.0, self.defaults["calls"] / 4)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update({**group, "lr": group["lr"] * warmup}, param, param.grad)
        return None


class ScheduleInStateDict(_PlainSGD):
    """Keeps a warm-up schedule in a dict on the optimizer, saved in its ``state_dict()`` (refused: it advances per
    batch)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, lr)
        self.schedule = {"t": 0, "warmup": 8}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.schedule["t"] += 1
        scale = min(1.0, self.schedule["t"] / self.schedule["warmup"])
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"] * scale)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "schedule": dict(self.schedule)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.schedule.update(state_dict.pop("schedule"))
        super().load_state_dict(state_dict)


class LogsItsSteps(_PlainSGD):
    """Counts its steps in a logging dict that no update reads (accepted: the update is per-parameter)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, lr)
        self.log = {"steps": 0}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.log["steps"] += 1
        return super().step(closure)


def _grads(params: list[torch.Tensor], step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def _attributes(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's own public attributes but its groups and state (``defaults``, schedules, logs)."""
    own = ("state", "param_groups", "step")
    return {key: value for key, value in vars(optimizer).items() if not key.startswith("_") and key not in own}


def _assert_same_values(expected: list[torch.Tensor], actual: list[torch.Tensor], when: str) -> None:
    for index, (expected_param, param) in enumerate(zip(expected, actual, strict=True)):
        assert_bitwise_equal(expected_param, param, f"parameter {index} {when}")


def _assert_a_never_wrapped_twin(
    plain: torch.optim.Optimizer,
    twin: torch.optim.Optimizer,
    params: list[torch.Tensor],
    what: str,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """``plain`` (refused, or wrapped as ``optimizer``) holds what ``twin`` holds and steps as it does, bitwise, for
    5 steps."""
    optimizer = optimizer or plain
    twin_params = [param for group in twin.param_groups for param in group["params"]]
    _assert_same_values(twin_params, params, f"{what}: after the wrap")
    expected_attributes = _attributes(twin)
    assert {key: _attributes(plain).get(key) for key in expected_attributes} == expected_attributes, what
    assert_state_dicts_equal(twin.state_dict(), optimizer.state_dict(), f"{what}: state_dict() after the wrap")
    for step in range(5):
        for values, stepped in ((params, optimizer), (twin_params, twin)):
            _grads(values, step)
            stepped.step()
    _assert_same_values(twin_params, params, f"{what}: 5 steps after the wrap")
    expected_state_dict, state_dict = twin.state_dict(), optimizer.state_dict()
    assert_state_dicts_equal(expected_state_dict, state_dict, f"{what}: state_dict() 5 steps after the wrap")
    assert {key: value for key, value in state_dict.items() if key not in ("state", "param_groups")} == {
        key: value for key, value in expected_state_dict.items() if key not in ("state", "param_groups")
    }, f"{what}: the state_dict()'s own entries 5 steps after the wrap"


REFUSED_BY_WHAT_THEY_SHARE = {
    "a counter in defaults": CountsInDefaults,
    "a schedule dict saved in the state_dict": ScheduleInStateDict,
}


@pytest.mark.parametrize("name", list(REFUSED_BY_WHAT_THEY_SHARE))
def test_a_refused_wrap_leaves_the_optimizers_attributes_as_a_never_wrapped_twins(name: str) -> None:
    cls = REFUSED_BY_WHAT_THEY_SHARE[name]
    params = _params()
    _grads(params, -1)  # a wrap after a backward: the gradients are there
    plain, twin = cls(params), cls(_params())
    with pytest.raises(UnsupportedOptimizerError, match=r"not per-parameter: .*gave different values"):
        swap_optimizer(plain, _config())
    _assert_a_never_wrapped_twin(plain, twin, params, name)


def test_an_accepted_wrap_leaves_the_optimizers_attributes_as_a_never_wrapped_twins() -> None:
    params = _params()
    plain, twin = LogsItsSteps(params), LogsItsSteps(_params())
    swapped = swap_optimizer(plain, _config(swap_times=1))  # one batch: the log counts one call per step
    assert plain.log == {"steps": 0}, "the probe's steps were logged on the optimizer"
    _assert_a_never_wrapped_twin(plain, twin, params, "a logging counter", swapped)
    assert plain.log == twin.log == {"steps": 5}


class ExitsOnAnyNonFinite(_PlainSGD):
    """Ends the program when any gradient is not finite, before updating anything (a training script's guard kept
    in the optimizer): a whole-step decision, refused."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        grads = [param.grad for group in self.param_groups for param in group["params"] if param.grad is not None]
        if not all(bool(torch.isfinite(grad).all()) for grad in grads):
            sys.exit("a non-finite gradient: stopping the run")
        return super().step(closure)


class ExitsOnItsOwnNonFinite(_PlainSGD):
    """Ends the program when the gradient of the parameter it is about to update is not finite (as torch would,
    parameters before it updated): per-parameter, accepted."""

    def _update(self, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor) -> None:
        if not bool(torch.isfinite(grad).all()):
            sys.exit("a non-finite gradient: stopping the run")
        super()._update(group, param, grad)


class InterruptedInStep(_PlainSGD):
    """Its step is interrupted (Ctrl-C while the probe runs)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        raise KeyboardInterrupt


def test_a_step_that_exits_on_any_non_finite_gradient_is_refused_without_ending_the_program() -> None:
    params = _params()
    _grads(params, -1)
    plain, twin = ExitsOnAnyNonFinite(params), ExitsOnAnyNonFinite(_params())
    rng = torch.random.get_rng_state()
    with pytest.raises(
        UnsupportedOptimizerError,
        match=r"ExitsOnAnyNonFinite's step is not per-parameter: .*both failing with SystemExit: a non-finite "
        r"gradient: stopping the run.*a non-finite gradient in one parameter.*swap_core.register_adapter",
    ):
        swap_optimizer(plain, _config())
    assert torch.equal(rng, torch.random.get_rng_state())
    _assert_a_never_wrapped_twin(plain, twin, params, "exits on any non-finite gradient")


def test_a_step_that_exits_on_its_own_parameters_non_finite_gradient_is_accepted() -> None:
    params = _params()
    plain, twin = ExitsOnItsOwnNonFinite(params), ExitsOnItsOwnNonFinite(_params())
    swapped = swap_optimizer(plain, _config())
    _assert_a_never_wrapped_twin(plain, twin, params, "exits on its own non-finite gradient", swapped)


def test_an_interrupt_in_the_probe_goes_through_with_everything_as_before() -> None:
    params = _params()
    _grads(params, -1)
    plain = InterruptedInStep(params)
    before = [param.detach().clone() for param in params]
    rng = torch.random.get_rng_state()
    with pytest.raises(KeyboardInterrupt):
        swap_optimizer(plain, _config())
    assert torch.equal(rng, torch.random.get_rng_state()), "the global RNG as it was"
    assert torch.is_grad_enabled(), "grad mode as it was"
    assert not plain.state and all(a is b for a, b in zip(plain.param_groups[0]["params"], params, strict=True))
    _assert_same_values(before, params, "after the interrupt")


class StepsInTrainModeOnly(torch.optim.Optimizer):
    """Steps only in train mode and is built in eval mode, as schedule-free optimizers are: ``train()`` before the
    first step. ``train()``/``eval()`` move each parameter between its sequences through its state ``z``, and the
    step counts in the group (``k``)."""

    def __init__(self, params: Any, lr: float = 0.1, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta, "k": 0, "train_mode": False})

    @torch.no_grad()
    def train(self) -> None:
        self._switch(train_mode=True)

    @torch.no_grad()
    def eval(self) -> None:
        self._switch(train_mode=False)

    def _switch(self, *, train_mode: bool) -> None:
        for group in self.param_groups:
            if group["train_mode"] != train_mode:
                weight = 1 - group["beta"] if train_mode else 1 - 1 / group["beta"]
                for param in group["params"]:
                    if "z" in self.state[param]:
                        param.lerp_(self.state[param]["z"], weight)
                group["train_mode"] = train_mode

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if not self.param_groups[0]["train_mode"]:
            raise Exception("Optimizer was not in train mode when step is called. Call .train() before stepping")
        for group in self.param_groups:
            group["k"] += 1
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "z" not in state:
                    state["z"] = param.detach().clone()
                state["z"].sub_(param.grad, alpha=group["lr"])
                param.lerp_(state["z"], 1 / (group["k"] + 1))
        return None


@pytest.mark.parametrize("mode", ["lazy", "random"])
def test_an_optimizer_built_in_eval_mode_is_swapped_when_wrapped_before_train(mode: str) -> None:
    """Users build a schedule-free optimizer, wrap it, then call ``train()`` in their loop."""
    params = _params()
    plain, twin = StepsInTrainModeOnly(params), StepsInTrainModeOnly(_params())
    swapped = swap_optimizer(plain, _config(backend=SimBackend(mode=mode, seed=3)))
    assert [group["train_mode"] for group in plain.param_groups] == [False], "the probe left the mode as it was"
    swapped.train()  # type: ignore[attr-defined]
    twin.train()
    _assert_a_never_wrapped_twin(plain, twin, params, "wrapped before train()", swapped)
    swapped.eval()  # type: ignore[attr-defined]
    twin.eval()
    _assert_same_values([param for group in twin.param_groups for param in group["params"]], params, "in eval mode")


class DelegatesToInner(torch.optim.Optimizer):
    """Steps a list of inner optimizers, one per parameter subset, and lists every parameter in its own groups (a
    composite optimizer)."""

    def __init__(self, params: Any) -> None:
        params = list(params)
        super().__init__(params, {"lr": 0.1})
        self._inner = [torch.optim.SGD(params[:2], lr=0.1, momentum=0.9), torch.optim.Adagrad(params[2:], lr=0.1)]

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for inner in self._inner:
            inner.step()
        return None


class DelegatesThroughAClosure(DelegatesToInner):
    """The same, its inner optimizers held only by the closure of a function kept as an attribute."""

    def __init__(self, params: Any) -> None:
        super().__init__(params)
        inner, self._inner = self._inner, []

        def step_every_inner() -> None:
            for optimizer in inner:
                optimizer.step()

        self._step_every_inner = step_every_inner

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self._step_every_inner()
        return None


DELEGATING = {
    "a list of inner optimizers": (DelegatesToInner, r"\(SGD at DelegatesToInner\._inner\[0\]\)"),
    "inner optimizers in a closure": (
        DelegatesThroughAClosure,
        r"\(SGD at DelegatesThroughAClosure\._step_every_inner \(its closure's 'inner'\)\[0\]\)",
    ),
}


@pytest.mark.parametrize("name", list(DELEGATING))
def test_an_optimizer_that_delegates_to_inner_optimizers_is_refused_before_any_is_stepped(name: str) -> None:
    cls, where = DELEGATING[name]
    params = _params()
    _grads(params, -1)
    plain, twin = cls(params), cls(_params())
    with pytest.raises(
        UnsupportedOptimizerError,
        match=rf"{cls.__name__} cannot be swapped: its step delegates to another optimizer {where}.*every batch "
        r"would step every parameter of the inner optimizer.*swap_optimizer\(inner\).*swap_core.register_adapter",
    ):
        swap_optimizer(plain, _config())
    for index, (expected, inner) in enumerate(zip(_inner(twin), _inner(plain), strict=True)):
        assert_state_dicts_equal(expected.state_dict(), inner.state_dict(), f"{name}: inner optimizer {index}")
    _assert_a_never_wrapped_twin(plain, twin, params, name)


def _inner(optimizer: DelegatesToInner) -> list[torch.optim.Optimizer]:
    if optimizer._inner:
        return optimizer._inner
    cells = optimizer._step_every_inner.__closure__ or ()  # type: ignore[attr-defined]
    return list(cells[0].cell_contents)
