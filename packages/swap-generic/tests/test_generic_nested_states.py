"""Optimizers that keep a state as a nested dict of tensors (issue 44, item 10): ``state[p]["moments"] =
{"exp_avg": ..., "exp_avg_sq": ...}``.

Before: refused at wrap time, whatever they declared ("keeps state 'moments' as a dict of tensors"). Now each value of
such a dict (one level deep, tensors and numbers) is a state key of its own while swapped (``"moments.exp_avg"``,
in host memory between steps), the optimizer's own step sees the nested dict, and ``state_dict()`` holds it exactly
as the plain optimizer's does: bitwise the plain optimizer over every simulator schedule, with the SwapConfig
variants (``prefetch="backward"``, ``step="in_backward"`` among them), master weights and checkpoints both ways.
What cannot be told apart stays refused, naming the key, its inner keys, the group and the parameter.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.errors import SwapStateError, UnsupportedOptimizerError
from swap_core.sim import SimBackend
from swap_core.testing.abandoned import Ending, abandon_a_step_begun_inside_the_backward
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_core.testing.conformance import (
    SIM_MODES,
    ConformanceCase,
    check_checkpoint_round_trip,
    check_parity,
    make_conformance_tests,
    through_torch_save,
)
from swap_core.testing.habits import HABIT_CHECKS
from swap_core.testing.masters import MasterReference, mixed_precision_params, set_same_grads
from swap_core.testing.pytest_plugin import BackendFactory


class NestedAdamW(torch.optim.Optimizer):
    """AdamW keeping each parameter's moments in a nested dict, its step count in the param group."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            params = [param for param in group["params"] if param.grad is not None]
            if params:
                step = self._count(group)
                for param in params:
                    self._update(param, self._moments(param), group, step)
        return None

    def _count(self, group: dict[str, Any]) -> int:
        group["step"] = step = group.get("step", 0) + 1
        return int(step)

    def _moments(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if "moments" not in state:
            state["moments"] = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
        moments: dict[str, Any] = state["moments"]
        return moments

    @staticmethod
    def _update(param: torch.Tensor, moments: dict[str, Any], group: dict[str, Any], step: int) -> None:
        assert param.grad is not None
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = moments["exp_avg"], moments["exp_avg_sq"]
        exp_avg.lerp_(param.grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
        denom = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(group["eps"])
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.addcdiv_(exp_avg, denom, value=-group["lr"] / (1 - beta1**step))


class CountedInTheNest(NestedAdamW):
    """The step count kept per parameter, as a number in the nested dict beside the moments; a scalar tensor of the
    parameter's running maximum gradient beside it in the state."""

    def _moments(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if "moments" not in state:
            state["grad_max"] = torch.zeros((), dtype=param.dtype, device=param.device)
            state["moments"] = {"step": 0, "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
        assert param.grad is not None
        torch.maximum(state["grad_max"], param.grad.abs().max(), out=state["grad_max"])
        moments: dict[str, Any] = state["moments"]
        moments["step"] += 1
        return moments

    def step(self, closure: Any = None) -> Any:
        with torch.no_grad():
            for group in self.param_groups:
                for param in [param for param in group["params"] if param.grad is not None]:
                    moments = self._moments(param)
                    self._update(param, moments, group, moments["step"])
        return None


CASES = [
    ConformanceCase(
        "nested_moments_step_in_the_nest",
        CountedInTheNest,
        dtypes=(torch.float32, torch.bfloat16),
        group_options=({}, {"lr": 0.02}),
    ),
]

globals().update(make_conformance_tests(CASES))


@pytest.mark.parametrize("habit", sorted(HABIT_CHECKS))
@pytest.mark.parametrize("step", ["after_backward", "in_backward"])
@pytest.mark.parametrize("mode,seed", [("lazy", 0), ("random", 5)], ids=["lazy0", "random5"])
def test_torch_habits_over_the_nested_live_state(
    habit: str, step: str, mode: str, seed: int, swap_backend_factory: BackendFactory
) -> None:
    """Every torch habit (resets, edits in place, loads through the wrapped optimizer...) meets the nested dict where
    torch's optimizer keeps it, after and inside the backward."""
    HABIT_CHECKS[habit](CASES[0], swap_backend_factory(mode=mode, seed=seed), step=step)


GROUP_STEP = ConformanceCase("nested_moments_group_step", NestedAdamW, group_options=({}, {"lr": 0.02}))
"""Its step writes its groups: inside the backward its batches are taken back and run in step() (a limit of
step="in_backward" for such steps; test_generic_bookkeeping.py steps such an optimizer with nested states there), so
it runs the parity and checkpoint checks."""


@pytest.mark.parametrize("prefetch", ["off", "backward"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("mode,seed", SIM_MODES[:6], ids=[f"{m}{s}" for m, s in SIM_MODES[:6]])
def test_group_step_parity_and_checkpoints(
    packed: bool, mode: str, seed: int, prefetch: str, swap_backend_factory: BackendFactory
) -> None:
    check_parity(GROUP_STEP, swap_backend_factory(mode=mode, seed=seed), packed=packed, prefetch=prefetch)
    check_checkpoint_round_trip(GROUP_STEP, swap_backend_factory(mode=mode, seed=seed), packed=packed)


SHAPES = ((16, 20), (3,), (8, 8), (30, 12))


def _params(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _run(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        set_same_grads(step, params)
        optimizer.step()


def _assert_as_twin(params: list[torch.Tensor], optimizer: Any, twin_params: list[torch.Tensor], twin: Any) -> None:
    for index, (expected, actual) in enumerate(zip(twin_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert_state_dicts_equal(twin.state_dict(), optimizer.state_dict(), "the state dict")


def _swapped(make: Callable[[Any], torch.optim.Optimizer], params: list[torch.Tensor]) -> Any:
    config = SwapConfig(backend=SimBackend(mode="random", seed=3), swap_times=2, min_numel=16)
    return swap_optimizer(make([{"params": params}]), config)


@pytest.mark.parametrize("make", [NestedAdamW, CountedInTheNest], ids=["group_step", "step_in_the_nest"])
def test_the_nested_tensors_live_in_host_memory_and_checkpoints_hold_the_nested_dict(
    make: Callable[[Any], torch.optim.Optimizer],
) -> None:
    twin_params, params = _params(), _params()
    twin, swapped = make([{"params": twin_params}]), _swapped(make, params)
    _run(twin_params, twin, range(3))
    _run(params, swapped, range(3))
    layout = swapped.host_layout()
    for param in params[:1] + params[2:]:  # the (3,) parameter's states are under min_numel: they stay
        assert layout.swapped_keys(param) == {"moments.exp_avg", "moments.exp_avg_sq"}
    assert swapped.stats.h2d_bytes == swapped.stats.d2h_bytes > 0
    saved = through_torch_save(swapped.state_dict())
    assert list(saved["state"][0]) == list(twin.state_dict()["state"][0])
    assert list(saved["state"][0]["moments"]) == list(twin.state_dict()["state"][0]["moments"])
    _assert_as_twin(params, swapped, twin_params, twin)
    # Between steps the live state is torch's: the nested dict in its place, holding the host mirrors.
    live, plain = swapped.state[params[0]], twin.state[twin_params[0]]
    assert list(live) == list(plain) and list(live["moments"]) == list(plain["moments"])
    for key in ("exp_avg", "exp_avg_sq"):
        assert_bitwise_equal(plain["moments"][key], live["moments"][key], f"the live moments[{key!r}]")


@pytest.mark.parametrize("step", ["after_backward", "in_backward"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_master_weights_run_over_the_nested_states(packed: bool, step: str) -> None:
    """bf16/fp16 parameters: bitwise the plain optimizer over fp32 masters, parameters and nested states."""
    params = mixed_precision_params()
    reference = MasterReference(mixed_precision_params(), lambda masters: CountedInTheNest([{"params": masters}]))
    config = SwapConfig(
        backend=SimBackend(mode="random", seed=4), swap_times=3, min_numel=64, master_weights=True, step=step
    )
    swapped = swap_optimizer(CountedInTheNest([{"params": params}]), config)
    for index in range(4):
        reference.set_grads(index, params)
        reference.step()
        swapped.step()
    assert {"moments.exp_avg", "moments.exp_avg_sq"} < swapped.host_layout().swapped_keys(params[0])
    for position, (expected, actual) in enumerate(zip(reference.params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {position}")
    saved, expected_state = swapped.state_dict()["state"], reference.optimizer.state_dict()["state"]
    for position, entry in expected_state.items():
        assert_state_dicts_equal(
            {"param_groups": [], "state": entry},
            {"param_groups": [], "state": {key: saved[position][key] for key in entry}},
            f"parameter {position}",
        )


def test_a_checkpoint_loaded_through_the_wrapped_optimizer_is_swapped_in_its_nested_place() -> None:
    """torch's own load (through the wrapped optimizer) puts new nested dicts in the live state: their tensors are
    taken into host memory before the next step, as for any state replaced by hand, and the steps go on bitwise."""
    twin_params, params = _params(), _params()
    twin, swapped = NestedAdamW([{"params": twin_params}]), _swapped(NestedAdamW, params)
    _run(twin_params, twin, range(2))
    _run(params, swapped, range(2))
    checkpoint = through_torch_save(twin.state_dict())
    swapped.optimizer.load_state_dict(through_torch_save(checkpoint))
    twin.load_state_dict(through_torch_save(checkpoint))
    _run(twin_params, twin, range(2, 5))
    _run(params, swapped, range(2, 5))
    _assert_as_twin(params, swapped, twin_params, twin)
    assert swapped.host_layout().swapped_keys(params[0]) == {"moments.exp_avg", "moments.exp_avg_sq"}


def test_states_nested_before_wrapping_are_swapped_and_kept_unswapped() -> None:
    """Made by steps before wrapping: their tensors move to host memory at wrap time, in their nested place; unswapped
    (CPU parameters, backend="auto") the plain step keeps them as they are. Bitwise the plain optimizer either way."""
    twin_params, params, cpu_params = _params(), _params(), _params()
    twin, optimizer = NestedAdamW([{"params": twin_params}]), NestedAdamW([{"params": params}])
    on_cpu = NestedAdamW([{"params": cpu_params}])
    for some_params, some_optimizer in ((twin_params, twin), (params, optimizer), (cpu_params, on_cpu)):
        _run(some_params, some_optimizer, range(2))
    swapped = swap_optimizer(optimizer, SwapConfig(backend=SimBackend(mode="lazy"), swap_times=2, min_numel=16))
    assert swapped.host_layout().swapped_keys(params[0]) == {"moments.exp_avg", "moments.exp_avg_sq"}
    unswapped = swap_optimizer(on_cpu, SwapConfig(backend="auto"))
    assert unswapped.backend is None
    for some_params, some_optimizer in ((twin_params, twin), (params, swapped), (cpu_params, unswapped)):
        _run(some_params, some_optimizer, range(2, 4))
    _assert_as_twin(params, swapped, twin_params, twin)
    _assert_as_twin(cpu_params, unswapped, twin_params, twin)
    saved = through_torch_save(twin.state_dict())
    for some_params, some_optimizer in ((twin_params, twin), (params, swapped), (cpu_params, unswapped)):
        some_optimizer.load_state_dict(through_torch_save(saved))
        _run(some_params, some_optimizer, range(4, 6))
    _assert_as_twin(params, swapped, twin_params, twin)
    _assert_as_twin(cpu_params, unswapped, twin_params, twin)


def test_a_nested_dict_set_by_hand_that_cannot_be_swapped_is_refused_before_the_step() -> None:
    """A dict nested deeper put in the live state by hand: refused before any batch updates anything, naming it."""
    params = _params()
    swapped = _swapped(NestedAdamW, params)
    _run(params, swapped, range(2))
    swapped.state[params[0]]["moments"] = {"first": {"exp_avg": torch.zeros(16, 20)}}
    before = [param.detach().clone() for param in params]
    with pytest.raises(SwapStateError, match=r"holds state 'moments' as a dict \('first'\) nested deeper than one"):
        _run(params, swapped, range(2, 3))
    for index, (expected, actual) in enumerate(zip(before, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} after the refused step")


class DeeperNest(NestedAdamW):
    """Keeps its moments one dict deeper: ``state["moments"]["first"] = {"exp_avg": ...}``."""

    def _moments(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if "moments" not in state:
            state["moments"] = {"first": {"exp_avg": torch.zeros_like(param)}, "exp_avg_sq": torch.zeros_like(param)}
        return {"exp_avg": state["moments"]["first"]["exp_avg"], "exp_avg_sq": state["moments"]["exp_avg_sq"]}


class ListInTheNest(NestedAdamW):
    """Keeps a list of past step sizes in the nested dict beside the moments."""

    def _moments(self, param: torch.Tensor) -> dict[str, Any]:
        moments = super()._moments(param)
        moments.setdefault("history", []).append(1.0)
        return moments


class KeyReadAsNested(NestedAdamW):
    """Keeps a tensor under ``"moments.extra"`` beside its nested ``"moments"``: the flat form would mistake it."""

    def _moments(self, param: torch.Tensor) -> dict[str, Any]:
        self.state[param].setdefault("moments.extra", torch.zeros_like(param))
        return super()._moments(param)


REFUSED: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], str]] = {
    "deeper": (
        DeeperNest,
        r"keeps state 'moments' as a dict \('first', 'exp_avg_sq'\) nested deeper than one level: 'moments'\['first'\] "
        r"is a dict \('exp_avg'\) \(param group 0's parameter 0, shape \(16, 20\)",
    ),
    "list": (
        ListInTheNest,
        r"keeps state 'moments' as a dict \('exp_avg', 'exp_avg_sq', 'history'\) holding a list under 'history' "
        r"\(param group 0's parameter 0, shape \(16, 20\)",
    ),
    "clash": (
        KeyReadAsNested,
        r"keeps state 'moments.extra' beside the dict of tensors 'moments'.* \(param group 0's parameter 0, shape "
        r"\(16, 20\)",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_nest_that_cannot_be_swapped_is_refused_naming_it(name: str) -> None:
    make, message = REFUSED[name]
    twin_params, params = _params(), _params()
    twin, optimizer = make([{"params": twin_params}]), make([{"params": params}])
    _run(twin_params, twin, range(2))
    _run(params, optimizer, range(2))
    checkpoint = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(UnsupportedOptimizerError, match=message):
        swap_optimizer(optimizer, SwapConfig(backend=SimBackend(mode="lazy"), swap_times=2, min_numel=16))
    assert_state_dicts_equal(checkpoint, optimizer.state_dict(), "the refused optimizer's state dict")
    _run(twin_params, twin, range(2, 4))
    _run(params, optimizer, range(2, 4))
    _assert_as_twin(params, optimizer, twin_params, twin)


class NestedWithModes(NestedAdamW):
    """Has schedule-free's ``train()``/``eval()`` (told by ``train_mode`` in its groups), which move each parameter
    toward its first moment, read from the nested dict outside ``step()``."""

    def __init__(self, params: Any) -> None:
        super().__init__(params)
        for group in self.param_groups:
            group["train_mode"] = True

    def train(self) -> None:
        self._switch(train_mode=True, weight=-0.25)

    def eval(self) -> None:
        self._switch(train_mode=False, weight=0.2)

    @torch.no_grad()
    def _switch(self, *, train_mode: bool, weight: float) -> None:
        for group in self.param_groups:
            if group["train_mode"] != train_mode:
                for param in group["params"]:
                    moments = self.state[param].get("moments")
                    if moments is not None:
                        param.lerp_(end=moments["exp_avg"].to(param.device), weight=weight)
                group["train_mode"] = train_mode


@pytest.mark.parametrize("master_weights", [False, True], ids=["plain", "master_weights"])
def test_nested_states_read_outside_the_step_are_read_in_their_place(master_weights: bool) -> None:
    """``eval()``/``train()`` read the first moment in the nested dict between steps (over the fp32 masters with
    master weights): bitwise the plain optimizer (over fp32 masters), then and after more steps."""
    params = mixed_precision_params() if master_weights else _params()
    config = SwapConfig(
        backend=SimBackend(mode="random", seed=6), swap_times=2, min_numel=16, master_weights=master_weights
    )
    swapped = swap_optimizer(NestedWithModes([{"params": params}]), config)
    reference = MasterReference(mixed_precision_params(), lambda masters: NestedWithModes([{"params": masters}]))
    twin_params = _params()
    twin = NestedWithModes([{"params": twin_params}])
    for steps in (range(3), range(3, 5)):
        if master_weights:
            for index in steps:
                reference.set_grads(index, params)
                reference.step()
                swapped.step()
        else:
            _run(twin_params, twin, steps)
            _run(params, swapped, steps)
        for switch in ("eval", "train", "eval"):
            getattr(swapped, switch)()
            if master_weights:
                getattr(reference.optimizer, switch)()
                reference.copy_masters_to_params()
                reference.assert_matches(swapped, params, f"after {switch}()")
            else:
                getattr(twin, switch)()
                _assert_as_twin(params, swapped, twin_params, twin)
        swapped.train()
        twin.train()
        reference.optimizer.train()
        reference.copy_masters_to_params()


@pytest.mark.parametrize("ending", ["zero_grad", "collected"])
def test_a_step_begun_inside_the_backward_and_abandoned_leaves_the_nested_states_as_before_it(ending: Ending) -> None:
    """The batches of a backward updated the nested moments (device copies in the nested dict) and the count kept in
    it; the loop abandons the step (``zero_grad()`` without ``step()``) or drops the optimizer (collected): the step is
    taken back, and the parameters and the nested states, in their place, are the plain optimizer's, which skipped
    that iteration."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    config = SwapConfig(backend=SimBackend(mode="lazy"), swap_times=3, min_numel=8, step="in_backward")
    run = abandon_a_step_begun_inside_the_backward(
        model,
        lambda some_model: CountedInTheNest([{"params": list(some_model.parameters())}]),
        config,
        ending,
        torch.randn(4, 16),
    )
    for index, (expected, actual) in enumerate(zip(run.twin_model.parameters(), run.model.parameters(), strict=True)):
        assert_bitwise_equal(expected, actual, f"after the abandoned step: parameter {index}")
    assert_state_dicts_equal(run.twin.state_dict(), run.wrapped.state_dict(), "after the abandoned step")
