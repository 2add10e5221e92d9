"""torch's own optimizer behaviours, over torch's own configurations, against every swap family.

torch tests its optimizers (``test/test_optim.py``, ``TestOptimRenewed``) by driving each one through the
configurations of its ``OptimizerInfo`` database (``optim_db``). This module does the same to each optimizer
swapped the way a user swaps it, with ``swap_optimizer``, so each family answers with its own adapter: swap-adam's
for Adam and AdamW, swap-muon's for Muon, swap-core's for RMSprop, swap-generic's for every other one. Each
behaviour is done to the swapped optimizer and to its plain twin on identical parameters, and the two are compared
bitwise (torch's tests after which each is modelled in brackets):

- steps with absent gradients (a no-op) and with zero gradients (``test_step_is_noop_when_params_have_no_grad``,
  ``test_step_is_noop_for_zero_grads``);
- step hooks on the instance and global ones, ``state_dict`` and ``load_state_dict`` hooks, in the order torch
  calls them (``test_step_pre_hook``, ``test_step_all_hooks``, ``test_state_dict_pre_hook``,
  ``test_load_state_dict_pre_hook_and_post_hook``...);
- state-dict round trips through ``torch.save`` between swapped and plain optimizers, both ways
  (``test_state_dict_deterministic``, ``test_save_load_equality_with_weights_only``);
- states edited in place between steps (``test_foreach_matches_forloop`` copies states in place);
- the foreach and fused variants (each configuration is run with the implementations torch offers on the CPU);
- the error inputs raised at the step (``test_errors``), and ``differentiable=True`` (refused at wrap time);
- printing and deep copies (``test_optimizer_can_be_printed``, ``test_deepcopy_copies_all_public_attrs``).

Every test passes, or is skipped with a reason naming where the docs say why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Literal

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from swap_core import swap_optimizer
from swap_core.errors import UnsupportedOptimizerError
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_core.testing.habits import check_deepcopy_and_pickle, check_state_edits_in_place
from swap_core.testing.optim_db import optim_db_configs, plain_refusal
from swap_core.testing.pairs import (
    ConformanceCase,
    Pair,
    make_groups,
    make_pair,
    set_grads,
    swap_config,
    through_torch_save,
)
from swap_core.testing.pytest_plugin import BackendFactory

common_optimizers = pytest.importorskip(
    "torch.testing._internal.common_optimizers", reason="torch's OptimizerInfo database needs expecttest"
)
pytest.importorskip("swap_adam", reason="every family is installed together for this module")
pytest.importorskip("swap_generic", reason="every family is installed together for this module")
pytest.importorskip("swap_muon", reason="every family is installed together for this module")

Mode = Literal["lazy", "random", "sync"]

REFUSED = {
    "LBFGS": "docs/generic.md, 'Refused by name': its step evaluates a closure over all parameters",
    "SparseAdam": "docs/generic.md, 'Limits': sparse gradients are refused, and SparseAdam takes nothing else",
}
"""Classes every behaviour would refuse at wrap time, with the docs row that says why (tested below)."""

SHAPES = ((48, 40), (40,), (16,), (24, 50), (8, 9))
MATRIX_SHAPES = ((48, 40), (40, 30), (8, 4), (64, 20))
"""Muon takes matrices only."""
SCHEDULE: tuple[Mode, int] = ("random", 3)
"""The simulator schedule of every behaviour but parity (which runs lazy and random)."""


def _configurations() -> Iterator[Any]:
    """One conformance case per optim_db input and implementation torch offers on the CPU."""
    for config in optim_db_configs(skip=REFUSED):
        yield pytest.param(_case(config.optimizer_cls, config.kwargs), id=config.id)


def _case(optimizer_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> ConformanceCase:
    return ConformanceCase(
        f"{optimizer_cls.__name__}({kwargs})",
        lambda groups: optimizer_cls(groups, **kwargs),
        shapes=MATRIX_SHAPES if optimizer_cls.__name__ == "Muon" else SHAPES,
        steps=4,
        skip_grad_every=3,
    )


CASES = list(_configurations())


def _skip_what_torch_refuses(case: ConformanceCase) -> None:
    """Skip a configuration that the plain optimizer itself refuses on the CPU (a CUDA-only option)."""
    refused = plain_refusal(case)
    if refused is not None:
        pytest.skip(f"plain torch refuses this configuration on the CPU: {refused}")


@pytest.fixture
def pair_of(swap_backend_factory: BackendFactory) -> Callable[[ConformanceCase], Pair]:
    def make(case: ConformanceCase) -> Pair:
        _skip_what_torch_refuses(case)
        mode, seed = SCHEDULE
        return make_pair(case, swap_backend_factory(mode=mode, seed=seed))

    return make


def test_every_torch_optimizer_is_covered() -> None:
    covered = {param.values[0].name.split("(")[0] for param in CASES} | set(REFUSED)
    assert covered == {info.optim_cls.__name__ for info in common_optimizers.optim_db}
    assert len(CASES) >= 100, len(CASES)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode,seed", [("lazy", 0), ("random", 1)], ids=["lazy", "random1"])
def test_steps_with_absent_and_zero_gradients(
    case: ConformanceCase, mode: Mode, seed: int, swap_backend_factory: BackendFactory
) -> None:
    _skip_what_torch_refuses(case)
    pair = make_pair(case, swap_backend_factory(mode=mode, seed=seed))
    pair.step_both(2)
    before = [param.detach().clone() for param in pair.swapped_params]
    state_before = through_torch_save(pair.swapped.state_dict())
    for optimizer, params in ((pair.reference, pair.reference_params), (pair.swapped, pair.swapped_params)):
        for param in params:
            param.grad = None
        optimizer.step()
    for index, (expected, actual) in enumerate(zip(before, pair.swapped_params, strict=True)):
        assert_bitwise_equal(expected, actual, f"{case.name}: parameter {index} after a step without gradients")
    assert_state_dicts_equal(state_before, pair.swapped.state_dict(), f"{case.name}: state after a no-op step")
    pair.assert_equal(f"{case.name}: after a step without gradients")
    for optimizer, params in ((pair.reference, pair.reference_params), (pair.swapped, pair.swapped_params)):
        for param in params:
            param.grad = torch.zeros_like(param)
        optimizer.step()
    pair.assert_equal(f"{case.name}: after a step with zero gradients")
    pair.step_both(2)
    pair.assert_equal(f"{case.name}: 2 steps later")


@pytest.mark.parametrize("case", CASES)
def test_hooks(case: ConformanceCase, pair_of: Callable[[ConformanceCase], Pair]) -> None:
    pair = pair_of(case)
    logs: dict[str, list[str]] = {}
    handles: list[Any] = []
    for name, optimizer in (("plain", pair.reference), ("swapped", pair.swapped)):
        log: list[str] = []
        logs[name] = log
        handles += _register_hooks(optimizer, log)
    global_log: list[tuple[str, torch.optim.Optimizer]] = []
    handles.append(register_optimizer_step_pre_hook(lambda opt, *_: global_log.append(("pre", opt))))
    handles.append(register_optimizer_step_post_hook(lambda opt, *_: global_log.append(("post", opt))))
    try:
        pair.step_both(2)
        saved = {
            name: optimizer.state_dict() for name, optimizer in (("plain", pair.reference), ("swapped", pair.swapped))
        }
        for name, state_dict in saved.items():
            assert state_dict["hooked"] is True, f"{case.name} ({name}): the state_dict post-hook's key is missing"
        pair.reference.load_state_dict(saved["plain"])
        pair.swapped.load_state_dict(saved["swapped"])
        for name, optimizer in (("plain", pair.reference), ("swapped", pair.swapped)):
            assert optimizer.param_groups[0]["lr_seen_by_load_pre_hook"] is True, name
        pair.step_both(1)
    finally:
        for handle in handles:
            handle.remove()
    assert logs["swapped"] == logs["plain"], f"{case.name}: hooks ran as {logs['swapped']}, torch ran {logs['plain']}"
    assert logs["plain"].count("step_pre") == 3
    expected_global = [(event, optimizer) for optimizer in (pair.reference, pair.swapped) for event in ("pre", "post")]
    assert [(event, opt) for event, opt in global_log] == expected_global * 2 + expected_global, (
        f"{case.name}: the global step hooks ran {[(event, type(opt).__name__) for event, opt in global_log]}"
    )
    pair.assert_equal(f"{case.name}: after the hooked steps and load")


def _register_hooks(optimizer: torch.optim.Optimizer, log: list[str]) -> list[Any]:
    """Every kind of optimizer hook, each checking that it is handed ``optimizer`` and logging its call."""

    def seen(event: str, given: torch.optim.Optimizer) -> None:
        assert given is optimizer, f"{event} was handed a {type(given).__name__}, not the optimizer it hooks"
        log.append(event)

    def state_dict_post(given: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        seen("state_dict_post", given)
        state_dict["hooked"] = True
        return state_dict

    def load_pre(given: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        seen("load_pre", given)
        state_dict = dict(state_dict)
        state_dict.pop("hooked")
        state_dict["param_groups"] = [
            {**group, "lr_seen_by_load_pre_hook": True} for group in state_dict["param_groups"]
        ]
        return state_dict

    return [
        optimizer.register_step_pre_hook(lambda given, args, kwargs: seen("step_pre", given)),
        optimizer.register_step_post_hook(lambda given, args, kwargs: seen("step_post", given)),
        optimizer.register_state_dict_pre_hook(lambda given: seen("state_dict_pre", given)),
        optimizer.register_state_dict_post_hook(state_dict_post),
        optimizer.register_load_state_dict_pre_hook(load_pre),
        optimizer.register_load_state_dict_post_hook(lambda given: seen("load_post", given)),
    ]


@pytest.mark.parametrize("case", CASES)
def test_state_dict_round_trips_both_ways(
    case: ConformanceCase, pair_of: Callable[[ConformanceCase], Pair], swap_backend_factory: BackendFactory
) -> None:
    pair = pair_of(case)
    pair.step_both(2)
    from_plain = through_torch_save(pair.reference.state_dict())
    from_swapped = through_torch_save(pair.swapped.state_dict())
    assert_state_dicts_equal(from_plain, from_swapped, f"{case.name}: the two checkpoints")
    # A swapped optimizer resumed from the plain one's checkpoint, and a plain one from the swapped one's.
    resumed_params = [param.detach().clone().requires_grad_() for param in pair.reference_params]
    resumed = swap_optimizer(
        case.make_optimizer(make_groups(case, resumed_params)), swap_config(case, swap_backend_factory(mode="lazy"))
    )
    resumed.load_state_dict(from_plain)
    plain_params = [param.detach().clone().requires_grad_() for param in pair.reference_params]
    plain = case.make_optimizer(make_groups(case, plain_params))
    plain.load_state_dict(from_swapped)
    for step in range(pair.steps_taken, pair.steps_taken + 2):
        for optimizer, params in ((resumed, resumed_params), (plain, plain_params)):
            set_grads(case, params, step)
            optimizer.step()
    pair.step_both(2)
    for name, optimizer, params in (
        ("swapped from plain", resumed, resumed_params),
        ("plain from swapped", plain, plain_params),
    ):
        for index, (expected, actual) in enumerate(zip(pair.reference_params, params, strict=True)):
            assert_bitwise_equal(expected, actual, f"{case.name} ({name}): parameter {index} 2 steps after the load")
        assert_state_dicts_equal(pair.reference.state_dict(), optimizer.state_dict(), f"{case.name} ({name})")


@pytest.mark.parametrize("case", CASES)
def test_states_edited_in_place_between_steps(case: ConformanceCase, swap_backend_factory: BackendFactory) -> None:
    _skip_what_torch_refuses(case)
    check_state_edits_in_place(case, swap_backend_factory(mode=SCHEDULE[0], seed=SCHEDULE[1]))


@pytest.mark.parametrize("case", CASES)
def test_printing_and_deep_copies(
    case: ConformanceCase, pair_of: Callable[[ConformanceCase], Pair], swap_backend_factory: BackendFactory
) -> None:
    pair = pair_of(case)
    pair.step_both(1)
    shown = repr(pair.swapped)
    assert type(pair.swapped.optimizer).__name__ in shown and "Parameter Group 0" in shown, shown
    check_deepcopy_and_pickle(case, swap_backend_factory(mode=SCHEDULE[0], seed=SCHEDULE[1]))


def _step_error_inputs() -> Iterator[Any]:
    step_error = common_optimizers.OptimizerErrorEnum.STEP_ERROR
    for info in common_optimizers.optim_db:
        for error_input in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
            if error_input.error_on == step_error:
                name = info.optim_cls.__name__
                yield pytest.param(info.optim_cls, error_input, id=f"{name}-{error_input.optimizer_error_input.desc}")


@pytest.mark.parametrize("optimizer_cls,error_input", list(_step_error_inputs()))
def test_error_inputs_raised_at_the_step(
    optimizer_cls: type[torch.optim.Optimizer], error_input: Any, swap_backend_factory: BackendFactory
) -> None:
    """The step's error torch raises, raised swapped too (at wrap time, or at the step before anything changes)."""
    given = error_input.optimizer_error_input

    def params() -> list[torch.Tensor]:
        made: list[torch.Tensor] = [torch.nn.Parameter(param.detach().clone()) for param in given.params]
        for param in made:
            param.grad = torch.ones_like(param)
        return made

    with pytest.raises(error_input.error_type, match=error_input.error_regex):
        optimizer_cls(params(), **given.kwargs).step()
    swapped_params = params()
    before = [param.detach().clone() for param in swapped_params]
    with pytest.raises(error_input.error_type, match=error_input.error_regex):
        swap_optimizer(optimizer_cls(swapped_params, **given.kwargs), backend=swap_backend_factory(mode="lazy")).step()
    for index, (expected, actual) in enumerate(zip(before, swapped_params, strict=True)):
        assert_bitwise_equal(expected, actual, f"{optimizer_cls.__name__} ({given.desc}): parameter {index}")


def _differentiable_configurations() -> Iterator[Any]:
    for info in common_optimizers.optim_db:
        if "differentiable" in info.supported_impls:
            yield pytest.param(info.optim_cls, id=info.optim_cls.__name__)


@pytest.mark.parametrize("optimizer_cls", list(_differentiable_configurations()))
def test_differentiable_is_refused_at_wrap_time(
    optimizer_cls: type[torch.optim.Optimizer], swap_backend_factory: BackendFactory
) -> None:
    """docs/behaviour.md, 'Refused, before anything changes': ``differentiable=True`` in any param group."""
    params = [torch.nn.Parameter(torch.randn(48, 40)), torch.nn.Parameter(torch.randn(40))]
    optimizer = optimizer_cls(params, differentiable=True)  # type: ignore[call-arg]  # each class listed takes it
    before = through_torch_save(optimizer.state_dict())  # Adagrad's constructor makes states
    with pytest.raises(UnsupportedOptimizerError, match="differentiable=True"):
        swap_optimizer(optimizer, backend=swap_backend_factory(mode="lazy"))
    assert type(optimizer.state) is type(before["state"]) or isinstance(optimizer.state, dict)
    assert_state_dicts_equal(before, optimizer.state_dict(), f"{optimizer_cls.__name__} after the refused wrap")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_families_are_refused_at_wrap_time(name: str, swap_backend_factory: BackendFactory) -> None:
    """Each class of :data:`REFUSED` is refused at wrap time, as its docs row says, with the optimizer untouched."""
    info = next(info for info in common_optimizers.optim_db if info.optim_cls.__name__ == name)
    optim_input = info.optim_inputs_func(device="cpu")[0]
    params = [torch.nn.Parameter(torch.randn(48, 40))]
    optimizer = info.optim_cls(params, **optim_input.kwargs)
    with pytest.raises(UnsupportedOptimizerError, match=name):
        swap_optimizer(optimizer, backend=swap_backend_factory(mode="lazy"))
    assert not optimizer.state and optimizer.param_groups[0]["params"] == params


def _complex_configurations() -> Iterator[Any]:
    """Each class whose error inputs do not refuse complex parameters, with its first input, default and foreach."""
    for info in common_optimizers.optim_db:
        name = info.optim_cls.__name__
        refused = any(
            "complex" in error.optimizer_error_input.desc
            for error in info.optim_error_inputs_func(device="cpu", dtype=torch.float32)
        )
        if name in REFUSED or refused:
            continue
        kwargs = info.optim_inputs_func(device="cpu")[0].kwargs
        yield pytest.param(info.optim_cls, kwargs, id=f"{name}-default_impl")
        if "foreach" in info.supported_impls:
            yield pytest.param(info.optim_cls, {**kwargs, "foreach": True}, id=f"{name}-foreach=True")


@pytest.mark.parametrize("optimizer_cls,kwargs", list(_complex_configurations()))
def test_complex_parameters(
    optimizer_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], swap_backend_factory: BackendFactory
) -> None:
    """docs/adam.md and docs/architecture.md: complex parameters step as torch steps them, their states resident."""
    case = dataclasses.replace(_case(optimizer_cls, kwargs), dtypes=(torch.complex64, torch.float32))
    pair = make_pair(case, swap_backend_factory(mode=SCHEDULE[0], seed=SCHEDULE[1]))
    pair.step_both(3)
    for index, (expected, actual) in enumerate(zip(pair.reference_params, pair.swapped_params, strict=True)):
        assert_bitwise_equal(
            torch.view_as_real(expected.detach()) if expected.is_complex() else expected,
            torch.view_as_real(actual.detach()) if actual.is_complex() else actual,
            f"{case.name}: parameter {index}",
        )
    swappable = any(
        isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() >= 64
        for param in pair.reference_params
        if not param.is_complex()
        for value in pair.reference.state[param].values()
    )
    assert (pair.swapped.stats.h2d_bytes > 0) == swappable, "the real parameters' large states are swapped"
