"""Optimizers that keep bookkeeping in their param groups and states (issue 44, item 10).

A collection of modern optimizers writes bookkeeping into its groups at every step ("is preconditioning" flags, a step
count), but only for the groups it has parameters to update; keeps its step counter only in the first parameter's
state; counts the parameters of each group; keeps states as nested dicts of tensors. Before: with two param groups
every such optimizer was refused at its first step (a batch over the other group wrote nothing into the first), and
the others were refused with "not per-parameter" and, where the step failed apart, an autograd explanation that did
not apply, never naming what blocked. Now the bookkeeping that the batches holding a group's parameters agree on is
swapped bitwise, nested dicts of tensors included (test_generic_nested_states.py); a step count kept in the group's
first parameter's state is lent to the first parameter of each batch (swap_generic.first_parameter_values), and
swapped bitwise in every mode, the first parameter with a gradient or without; and every refusal names the key, the
group and the parameter that blocked, and the fix.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.errors import UnsupportedOptimizerError
from swap_core.sim import SimBackend
from swap_core.testing.abandoned import Ending, abandon_a_step_begun_inside_the_backward
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_core.testing.conformance import ConformanceCase, make_conformance_tests

SHAPES = ((16, 20), (3,), (8, 8), (30, 12), (40,), (6, 4))


class _Modern(torch.optim.Optimizer):
    """AdamW over each group's parameters that have a gradient (a group without any is skipped, writing nothing);
    subclasses keep the step count and the states as the collection does."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            params = [param for param in group["params"] if param.grad is not None]
            if not params:
                continue
            step = self._count(group)
            for param in params:
                exp_avg, exp_avg_sq = self._moments(param)
                self._adamw(param, exp_avg, exp_avg_sq, group, step)
        return None

    def _count(self, group: dict[str, Any]) -> int:
        """The group's step count, counted once per step (here in the group, with a flag written every step)."""
        group["step"] = step = group.get("step", 0) + 1
        group["is_preconditioning"] = step % 2 == 0
        return step

    def _moments(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.state[param]
        if "exp_avg" not in state:
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(param), torch.zeros_like(param)
        return state["exp_avg"], state["exp_avg_sq"]

    @staticmethod
    def _adamw(
        param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, group: dict[str, Any], step: int
    ) -> None:
        assert param.grad is not None
        beta1, beta2 = group["betas"]
        exp_avg.lerp_(param.grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
        if group.get("is_preconditioning", True):
            denom = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(group["eps"])
        else:
            denom = torch.ones_like(exp_avg_sq)
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.addcdiv_(exp_avg, denom, value=-group["lr"] / (1 - beta1**step))


class GroupBookkeeping(_Modern):
    """Counts steps in its groups and writes an "is preconditioning" flag into them, for groups with parameters."""


class FirstParameterCounter(_Modern):
    """Keeps the group's step count only in the state of the group's first parameter."""

    def _count(self, group: dict[str, Any]) -> int:
        first = self.state[group["params"][0]]
        first["step"] = step = first.get("step", 0) + 1
        return int(step)


class FirstParameterCounterMadeOnce(_Modern):
    """The same counter, made by the constructor in the first parameter's state and read from there (run one batch
    at a time, a later batch fails: its first parameter has no counter)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params)
        for group in self.param_groups:
            if group["params"]:
                self.state[group["params"][0]]["step"] = 0

    def _count(self, group: dict[str, Any]) -> int:
        first = self.state[group["params"][0]]
        first["step"] += 1
        return int(first["step"])


class CountsParameters(_Modern):
    """Writes how many parameters each group updates into the group, every step."""

    def _count(self, group: dict[str, Any]) -> int:
        group["param_count"] = sum(param.grad is not None for param in group["params"])
        return super()._count(group)


class NestedStates(_Modern):
    """Keeps each parameter's moments in a nested dict of tensors (and its step count in its groups)."""

    def _moments(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.state[param]
        if "moments" not in state:
            state["moments"] = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
        return state["moments"]["exp_avg"], state["moments"]["exp_avg_sq"]


class AllHabits(FirstParameterCounter, NestedStates):
    """The step count in the first parameter's state and the moments in nested dicts at once."""


class FirstParameterGradientSum(FirstParameterCounter):
    """Beside the count, keeps a running sum of the squares of the group's gradients in the first parameter's state:
    a value of the whole group that is no count (each batch would sum its own share's)."""

    def _count(self, group: dict[str, Any]) -> int:
        first = self.state[group["params"][0]]
        total = sum(float(param.grad.pow(2).sum()) for param in group["params"] if param.grad is not None)
        first["grad_sq"] = first.get("grad_sq", 0.0) + total
        return super()._count(group)


class FirstParameterMaxDim(FirstParameterCounter):
    """Beside the count, keeps the largest number of dimensions among the group's parameters with a gradient in the
    first parameter's state: the probe's stand-ins of one layout all agree on it, a real group of matrices and
    vectors does not."""

    def _count(self, group: dict[str, Any]) -> int:
        self.state[group["params"][0]]["dims"] = max(param.dim() for param in group["params"] if param.grad is not None)
        return super()._count(group)


class FailsWhenAsked(FirstParameterCounter):
    """Raises, before it updates anything, when its step is given :attr:`fail_with` (a failure in a later batch)."""

    fail_with: torch.Tensor | None = None

    def _count(self, group: dict[str, Any]) -> int:
        if any(param is self.fail_with for param in group["params"]):
            raise RuntimeError("the step failed here")
        return super()._count(group)


def _params(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _groups(params: list[torch.Tensor]) -> list[dict[str, Any]]:
    return [{"params": params[:3]}, {"params": params[3:], "lr": 0.02}]


def _run(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(100 + step)
        for index, param in enumerate(params):
            grad = torch.randn(param.shape, generator=generator)
            param.grad = None if (step + index) % 4 == 0 else grad  # now and then no gradient
        optimizer.step()


def _assert_as_twin(params: list[torch.Tensor], optimizer: Any, twin_params: list[torch.Tensor], twin: Any) -> None:
    for index, (expected, actual) in enumerate(zip(twin_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert_state_dicts_equal(twin.state_dict(), optimizer.state_dict(), "the state dict")


SCHEDULES = {
    "lazy": lambda: SimBackend(mode="lazy"),
    "sync": lambda: SimBackend(mode="sync"),
    "random_2": lambda: SimBackend(mode="random", seed=2),
    "random_9": lambda: SimBackend(mode="random", seed=9),
}


SWAPPED = {
    "group_bookkeeping": GroupBookkeeping,
    "and_nested_states": NestedStates,
    "first_parameter_counter": FirstParameterCounter,
    "first_parameter_counter_made_once": FirstParameterCounterMadeOnce,
    "first_parameter_counter_and_nested_states": AllHabits,
}


@pytest.mark.parametrize("prefetch", ["off", "backward"])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("make", list(SWAPPED.values()), ids=list(SWAPPED))
def test_group_bookkeeping_the_batches_agree_on_is_swapped_bitwise(
    make: Callable[[Any], torch.optim.Optimizer], schedule: str, packed: bool, prefetch: str
) -> None:
    twin_params, params = _params(), _params()
    twin = make(_groups(twin_params))
    config = SwapConfig(backend=SCHEDULES[schedule](), swap_times=4, min_numel=16, packed=packed, prefetch=prefetch)
    swapped = swap_optimizer(make(_groups(params)), config)
    _run(twin_params, twin, range(5))
    _run(params, swapped, range(5))
    _assert_as_twin(params, swapped, twin_params, twin)
    assert [group.get("step") for group in swapped.param_groups] == [group.get("step") for group in twin.param_groups]
    _assert_every_large_state_swapped(swapped, params, twin, twin_params)


def _assert_every_large_state_swapped(
    swapped: Any, params: list[torch.Tensor], twin: Any, twin_params: list[Any]
) -> None:
    """Each state tensor of at least 16 elements (the tests' ``min_numel``) is in host memory, under its flat name:
    also those a step added to a state made earlier (the first parameter's moments, made after the step count its
    group's batches wrote there while it had no gradient)."""
    layout = swapped.host_layout()
    for index, (param, twin_param) in enumerate(zip(params, twin_params, strict=True)):
        flat = {}
        for key, value in twin.state[twin_param].items():
            flat.update(
                {f"{key}.{inner}": v for inner, v in value.items()} if isinstance(value, dict) else {key: value}
            )
        large = {key for key, value in flat.items() if isinstance(value, torch.Tensor) and value.numel() >= 16}
        assert layout.swapped_keys(param) == large, f"parameter {index}: {layout.swapped_keys(param)} != {large}"


@pytest.mark.parametrize(
    "make",
    [GroupBookkeeping, NestedStates, FirstParameterCounter],
    ids=["group_bookkeeping", "and_nested_states", "first_parameter_counter"],
)
def test_group_bookkeeping_inside_the_backward(make: Callable[[Any], torch.optim.Optimizer]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    twin_model = copy.deepcopy(model)
    twin = make([{"params": list(twin_model[0].parameters())}, {"params": list(twin_model[1].parameters())}])
    config = SwapConfig(backend=SimBackend(mode="random", seed=1), swap_times=3, min_numel=8, step="in_backward")
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[1].parameters())}]
    swapped = swap_optimizer(make(groups), config)
    inputs = torch.randn(4, 16)
    for _ in range(4):
        for some_model, optimizer in ((twin_model, twin), (model, swapped)):
            some_model(inputs).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    _assert_as_twin(list(model.parameters()), swapped, list(twin_model.parameters()), twin)
    assert swapped.stats.batches == 3
    if make is FirstParameterCounter:  # its groups are left alone: the step inside the backward commits
        assert swapped.stats.batches_in_backward == 3 and swapped.stats.batches_taken_back == 0, swapped.stats
    else:
        # The step writes its groups, which the in-backward driver takes as a change since the step began: the
        # batches are taken back and run again in step() (bitwise either way; a limit of step="in_backward", not of
        # the bookkeeping).
        assert swapped.stats.batches_taken_back == 3, swapped.stats


REFUSED: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], str]] = {
    "first_parameter_gradient_sum": (
        FirstParameterGradientSum,
        r"keeps 'grad_sq' only in the state of its group's first parameter \(param group 0's parameter 0, shape "
        r"\(16, 20\)\).*it is not a value of the group.*left 'grad_sq' in the state of the first parameter of two "
        r"shares of param group 0 differently.*group\['grad_sq'\]",
    ),
    "counts_parameters": (
        CountsParameters,
        r"wrote param group 0's 'param_count' differently \(2 against 1\): the step writes it from the parameters it "
        r"is given \(2 for two stand-in parameters stepped together, 1 for each alone\)",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refusal_names_what_blocked_and_changes_nothing(name: str) -> None:
    make, message = REFUSED[name]
    twin_params, params = _params(), _params()
    twin, optimizer = make(_groups(twin_params)), make(_groups(params))
    _run(twin_params, twin, range(2))
    _run(params, optimizer, range(2))
    checkpoint = copy.deepcopy(optimizer.state_dict())
    config = SwapConfig(backend=SimBackend(mode="lazy"), swap_times=3, min_numel=16)
    with pytest.raises(UnsupportedOptimizerError, match=message) as refusal:
        swap_optimizer(optimizer, config)
    assert "autograd" not in str(refusal.value) and "graph" not in str(refusal.value), str(refusal.value)
    assert_state_dicts_equal(checkpoint, optimizer.state_dict(), "the refused optimizer's state dict")
    _run(twin_params, twin, range(2, 5))
    _run(params, optimizer, range(2, 5))
    _assert_as_twin(params, optimizer, twin_params, twin)


def test_a_failed_step_puts_back_the_count_a_batch_wrote_for_a_first_parameter_without_a_gradient() -> None:
    """With ``undo_failed_steps``: the first parameter has no gradient, so the first batch of its group writes the
    group's count into its state; a later batch of the group fails. The step is undone whole, that count included (the
    runtime kept the entry with the batch, ``entries_written_beside``), and the same step taken again is bitwise the
    plain optimizer's single step."""
    twin_params, params = _params(), _params()
    twin, optimizer = FailsWhenAsked(_groups(twin_params)), FailsWhenAsked(_groups(params))
    config = SwapConfig(backend=SimBackend(mode="random", seed=4), swap_times=3, min_numel=16, undo_failed_steps=True)
    swapped = swap_optimizer(optimizer, config)
    for some_params, some_optimizer in ((twin_params, twin), (params, swapped)):
        _run(some_params, some_optimizer, range(1, 3))  # the first parameter has a gradient at steps 1 and 2
    count = int(swapped.state[params[0]]["step"])
    generator = torch.Generator().manual_seed(7)
    grads = [None, *(torch.randn(param.shape, generator=generator) for param in params[1:])]
    for some_params in (twin_params, params):
        for param, grad in zip(some_params, grads, strict=True):
            param.grad = None if grad is None else grad.clone()
    optimizer.fail_with = params[2]  # the batch after the one of the resident parameters[1]
    with pytest.raises(RuntimeError, match="the step failed here"):
        swapped.step()
    assert swapped.state[params[0]]["step"] == count, "the failed step's count was not put back"
    optimizer.fail_with = None
    swapped.step()
    twin.step()
    assert swapped.state[params[0]]["step"] == count + 1
    _assert_as_twin(params, swapped, twin_params, twin)


def test_a_first_parameter_value_the_batches_disagree_on_is_refused_at_the_step_naming_it() -> None:
    """A value kept in the first parameter's state that the probe's stand-ins agree on but a real group's batches do
    not: the step is refused when the batch that disagrees has run, naming the key, the group and both values (the
    batches before it were updated, as the error's note says)."""
    params = _params()
    swapped = swap_optimizer(FirstParameterMaxDim(_groups(params)), SwapConfig(backend=SimBackend(), min_numel=16))
    generator = torch.Generator().manual_seed(3)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    with pytest.raises(
        UnsupportedOptimizerError,
        match=r"left 'dims' in the state of the first parameter of two "
        r"shares of param group 0 differently \((1 against 2|2 against 1)\)",
    ):
        swapped.step()


class _Unused(torch.nn.Module):
    """A parameter first in its group that never takes a gradient, then two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Parameter(torch.randn(12, 12))
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(inputs))

    def groups(self) -> list[dict[str, Any]]:
        return [{"params": [self.unused, *self.a.parameters()]}, {"params": list(self.b.parameters())}]


def test_a_step_taken_back_inside_the_backward_puts_back_the_count_its_batches_wrote() -> None:
    """Inside the backward, the first parameter of a group never has a gradient: each batch of its group writes the
    group's count into its state. A step that clips between backward and step is taken back (its count too) and runs
    again after the backward; one that does not commits. Bitwise the plain optimizer either way."""
    torch.manual_seed(0)
    model = _Unused()
    twin_model = copy.deepcopy(model)
    twin = FirstParameterCounter(twin_model.groups())
    config = SwapConfig(backend=SimBackend(mode="random", seed=1), swap_times=3, min_numel=8, step="in_backward")
    swapped = swap_optimizer(FirstParameterCounter(model.groups()), config)
    inputs = torch.randn(4, 16)
    in_backward = taken_back = 0
    for step in range(6):
        for some_model, optimizer in ((twin_model, twin), (model, swapped)):
            some_model(inputs).pow(2).sum().backward()
            if step % 2:
                torch.nn.utils.clip_grad_norm_(list(some_model.parameters()), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        in_backward += swapped.stats.batches_in_backward
        taken_back += swapped.stats.batches_taken_back
        assert swapped.state[model.unused]["step"] == twin.state[twin_model.unused]["step"] == step + 1
    _assert_as_twin(list(model.parameters()), swapped, list(twin_model.parameters()), twin)
    assert in_backward > 0 and taken_back > 0, (in_backward, taken_back)


@pytest.mark.parametrize("ending", ["zero_grad", "collected"])
def test_a_step_begun_inside_the_backward_and_abandoned_leaves_the_count_as_before_it(ending: Ending) -> None:
    """The batches of a backward wrote the group's count into its first parameter's state (it has no gradient); the
    loop then abandons the step (``zero_grad()`` without ``step()``) or drops the optimizer (``del``, collected): the
    step is taken back, that count included, and the parameters and states are the plain optimizer's, which skipped
    that iteration."""
    torch.manual_seed(0)
    config = SwapConfig(backend=SimBackend(mode="lazy"), swap_times=4, min_numel=8, step="in_backward")
    run = abandon_a_step_begun_inside_the_backward(
        _Unused(), lambda model: FirstParameterCounter(model.groups()), config, ending, torch.randn(4, 16)
    )
    for index, (expected, actual) in enumerate(zip(run.twin_model.parameters(), run.model.parameters(), strict=True)):
        assert_bitwise_equal(expected, actual, f"after the abandoned step: parameter {index}")
    assert run.wrapped.state[run.model.unused]["step"] == run.twin.state[run.twin_model.unused]["step"] == 3
    if ending == "zero_grad":
        assert_state_dicts_equal(run.twin.state_dict(), run.wrapped.state_dict(), "after the abandoned step")


COUNTER_CASE = ConformanceCase(
    "first_parameter_counter",
    FirstParameterCounter,
    dtypes=(torch.float32, torch.bfloat16),
    group_options=({}, {"lr": 0.02}),
)
"""The whole conformance suite over a step count kept in each group's first parameter's state (the first parameter
takes no gradient every fourth step: the count is written from another batch then)."""

globals().update(make_conformance_tests([COUNTER_CASE]))
