"""What torch users do to an optimizer, done to a swapped one and to its plain twin: same result, or a clear refusal.

Each check drives a :class:`~swap_core.testing.pairs.Pair` (the unwrapped reference and the swapped
optimizer on identical parameters), does the same thing to both (reset a state the torch way, edit
``param_groups`` by hand, load through the wrapped optimizer, deep-copy...), and asserts that they
stay bitwise equal. Where swapping refuses (a repeated parameter, an incomplete checkpoint, a
second wrapper), the check asserts the error type and the words that name the problem, and that
the swapped optimizer is exactly as it was: it then goes on stepping equal to the reference.

:data:`HABIT_CHECKS` is what ``make_conformance_tests`` runs for every family.
"""

from __future__ import annotations

import copy
import functools
import io
import pickle
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..backends.protocol import DeviceBackend
from ..errors import StateDictMismatchError, SwapStateError, UnsupportedOptimizerError
from ..runtime.nested_entries import flat_items, located
from ..runtime.tracked_state import TrackedState
from ..torch_compat import hook_registries
from .compare import assert_bitwise_equal, assert_state_dicts_equal
from .pairs import (
    ConformanceCase,
    Pair,
    give_grads,
    make_groups,
    make_pair,
    make_params,
    swap_config,
    through_torch_save,
    wrap_case,
)

__all__ = [
    "HABIT_CHECKS",
    "check_bypassed_overrides",
    "check_deepcopy_and_pickle",
    "check_duplicate_params",
    "check_edited_param_groups",
    "check_empty_optimizer",
    "check_hooks_and_schedulers_before_wrapping",
    "check_incomplete_checkpoints",
    "check_late_first_gradient",
    "check_load_through_the_wrapped_optimizer",
    "check_second_wrapper",
    "check_state_edits_in_place",
    "check_state_resets",
]

HabitCheck = Callable[..., None]
"""A check of :data:`HABIT_CHECKS`: ``check(case, backend, **overrides)``, the overrides going to ``SwapConfig``."""


def check_state_resets(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """``del opt.state[p]``, ``opt.state[p] = {}``, ``opt.state.clear()``, a new tensor for a swapped key."""
    resets: dict[str, Callable[[torch.optim.Optimizer, list[torch.Tensor]], None]] = {
        "del": lambda optimizer, params: optimizer.state.__delitem__(params[0]),
        "empty": lambda optimizer, params: optimizer.state.__setitem__(params[-1], {}),
        "clear": lambda optimizer, params: optimizer.state.clear(),
        "replace": _halve_a_swapped_state,
    }
    for name, reset in resets.items():
        pair = make_pair(case, backend, **overrides)
        pair.step_both(2)
        reset(pair.reference, pair.reference_params)
        reset(pair.swapped, pair.swapped_params)
        if name == "empty":
            pair.swapped.reset_optimizer_parameters()  # the torch-way reset, then the swap-way re-plan
        pair.assert_equal(f"{case.name}: right after the {name!r} reset")  # the checkpoint holds the live state
        pair.step_both(3)
        pair.assert_equal(f"{case.name}: 3 steps after the {name!r} reset")


def check_state_edits_in_place(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """A state edited in place between steps, as torch users do (a moment halved after a loss spike, zeroed, or
    overwritten with ``copy_``): the next step runs on the edit, even though the last step's copy to host memory
    may still be in flight when the edit is made (reading ``opt.state`` waits for it)."""
    edits: dict[str, Callable[[torch.Tensor], object]] = {
        "mul_": lambda value: value.mul_(0.5),
        "zero_": lambda value: value.zero_(),
        "copy_": lambda value: value.copy_(torch.full_like(value, 0.25)),
    }
    for name, edit in edits.items():
        pair = make_pair(case, backend, **overrides)
        pair.step_both(2)
        for optimizer, params in ((pair.reference, pair.reference_params), (pair.swapped, pair.swapped_params)):
            for param in params:
                for value in optimizer.state[param].values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.is_floating_point():
                        edit(value)
        pair.step_both(2)
        pair.assert_equal(f"{case.name}: 2 steps after every state was edited in place ({name})")


def check_late_first_gradient(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """A parameter without a gradient in the first steps (frozen, then unfrozen; a branch used later) gets its
    state at its first gradient, and the states of the others go on from where they were."""
    pair = make_pair(case, backend, **overrides)
    params = pair.reference_params
    late = max(range(len(params)), key=lambda index: (params[index].numel(), index))  # one whose states are swapped
    for _ in range(2):
        for params, optimizer in ((pair.reference_params, pair.reference), (pair.swapped_params, pair.swapped)):
            give_grads(case, optimizer, params, pair.steps_taken, without={late})
            optimizer.step()
        pair.steps_taken += 1
    pair.step_both(3)
    pair.assert_equal(f"{case.name}: 3 steps after parameter {late} got its first gradient")


def check_edited_param_groups(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """Groups edited by hand: reordered (same-shaped params included), appended to, shortened, replaced."""
    case = _with_a_twin_shape(case)
    edits: dict[str, Callable[[Pair, torch.optim.Optimizer, list[torch.Tensor]], None]] = {
        "reverse": lambda pair, optimizer, params: optimizer.param_groups[0]["params"].reverse(),
        "swap_same_shape": lambda pair, optimizer, params: _swap_first_and_last(optimizer),
        "new_list": lambda pair, optimizer, params: optimizer.param_groups[0].__setitem__(
            "params", list(reversed(optimizer.param_groups[0]["params"]))
        ),
        "append": _append_a_param,
        "drop": _drop_a_param,
        "inner_add_param_group": _add_a_group_through_the_wrapped_optimizer,
    }
    for name, edit in edits.items():
        pair = make_pair(case, backend, **overrides)
        pair.step_both(2)
        edit(pair, pair.reference, pair.reference_params)
        wrapped = pair.swapped.optimizer if name == "inner_add_param_group" else pair.swapped
        edit(pair, wrapped, pair.swapped_params)
        pair.step_both(3)
        pair.assert_equal(f"{case.name}: 3 steps after the {name!r} edit of param_groups")


def check_duplicate_params(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """A parameter twice in a group is refused at wrap time, and when a hand edit repeats one, before any change."""
    params = make_params(case, backend.device)
    groups = make_groups(case, params)
    groups[0]["params"].append(groups[0]["params"][0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns about the repeated parameter, then accepts it
        plain = case.make_optimizer(groups)
    _expect_error(
        UnsupportedOptimizerError,
        r"appears twice in param group 0 \(positions 0 and \d+\)",
        lambda: wrap_case(case, plain, swap_config(case, backend, **overrides)),
    )
    _assert_never_wrapped(plain, f"{case.name}: refused for a repeated parameter")
    pair = make_pair(case, backend, **overrides)
    pair.step_both(2)
    before = _snapshot(pair)
    group = pair.swapped.param_groups[0]["params"]
    group.append(group[0])
    give_grads(case, pair.swapped, pair.swapped_params, pair.steps_taken)
    _expect_error(UnsupportedOptimizerError, "appears twice in param group 0", pair.swapped.step)
    group.pop()
    _assert_unchanged(pair, before, "after a refused step with a repeated parameter")
    pair.step_both(2)
    pair.assert_equal(f"{case.name}: after the repeated parameter was removed again")


def check_empty_optimizer(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """An optimizer without parameters steps nothing (torch's no-op), then takes a group like torch's."""
    reference = case.make_optimizer([{"params": []}])
    swapped = wrap_case(case, case.make_optimizer([{"params": []}]), swap_config(case, backend, **overrides))
    reference.step()
    swapped.step()
    assert_state_dicts_equal(reference.state_dict(), swapped.state_dict(), f"{case.name}: empty optimizer")
    reference_params, swapped_params = make_params(case, backend.device), make_params(case, backend.device)
    reference.add_param_group({"params": reference_params})
    swapped.add_param_group({"params": swapped_params})
    pair = Pair(case, reference_params, reference, swapped_params, swapped)
    pair.step_both(3)
    pair.assert_equal(f"{case.name}: an empty optimizer given a param group")


def check_deepcopy_and_pickle(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """``copy.deepcopy`` gives an independent working optimizer; pickling says to save ``state_dict()``."""
    pair = make_pair(case, backend, **overrides)
    pair.step_both(2)
    twin = Pair(case, [], copy.deepcopy(pair.reference), [], copy.deepcopy(pair.swapped), pair.steps_taken)
    twin.reference_params = [param for group in twin.reference.param_groups for param in group["params"]]
    twin.swapped_params = [param for group in twin.swapped.param_groups for param in group["params"]]
    assert not set(map(id, twin.swapped_params)) & set(map(id, pair.swapped_params)), "deepcopy shared parameters"
    assert repr(twin.swapped).startswith("SwapOptimizer("), repr(twin.swapped)
    twin.step_both(3)
    twin.assert_equal(f"{case.name}: a deep copy, 3 steps on")
    pair.step_both(1)
    pair.assert_equal(f"{case.name}: the original after its deep copy stepped")
    for save in (lambda: pickle.dumps(pair.swapped), lambda: torch.save(pair.swapped, io.BytesIO())):
        _expect_error(TypeError, r"Save optimizer\.state_dict\(\) instead", save)


def check_load_through_the_wrapped_optimizer(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """``opt.optimizer.load_state_dict(...)`` (the plain one) is followed by the swapped optimizer."""
    pair = make_pair(case, backend, **overrides)
    pair.step_both(2)
    checkpoint = through_torch_save(pair.reference.state_dict())  # a copy: state_dict() holds the live tensors
    pair.step_both(2)
    # One copy each: torch's load keeps the loaded tensors, which two optimizers must not share.
    pair.reference.load_state_dict(through_torch_save(checkpoint))
    pair.swapped.optimizer.load_state_dict(through_torch_save(checkpoint))
    pair.assert_equal(f"{case.name}: right after a load through the wrapped optimizer")
    pair.step_both(3)
    pair.assert_equal(f"{case.name}: 3 steps after a load through the wrapped optimizer")


def check_incomplete_checkpoints(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """A checkpoint lacking a state key, or with an unknown one, is refused at load naming both; nothing changes.

    Loaded through the wrapped optimizer instead (torch's load takes anything), the next step refuses it
    before any parameter changes. (A family with a single state key has no "lacking" checkpoint: without
    its one key an entry is empty, which means a fresh state, as in torch.)
    """
    pair = make_pair(case, backend, **overrides)
    pair.step_both(2)
    good = through_torch_save(pair.reference.state_dict())
    index, key = _last_swapped_key(good)
    unknown = copy.deepcopy(good)
    unknown["state"][index]["not_a_state_key"] = torch.zeros(3)
    bad_checkpoints = [(unknown, "has 'not_a_state_key'")]
    if len(list(flat_items(good["state"][index], nested=True))) > 1:
        lacking = copy.deepcopy(good)
        container, leaf = located(lacking["state"][index], key)  # a nested dict's value by its path
        del container[leaf]
        bad_checkpoints.insert(0, (lacking, f"lacks '{key}'"))
    for bad, words in bad_checkpoints:
        before = _snapshot(pair)
        pattern = rf"parameter {index}\b.*{re.escape(words)}"
        _expect_error(StateDictMismatchError, pattern, functools.partial(pair.swapped.load_state_dict, bad))
        _assert_unchanged(pair, before, f"after refusing a checkpoint that {words}")
    bad, words = bad_checkpoints[0]
    pair.swapped.optimizer.load_state_dict(bad)
    before_params = [param.detach().clone() for param in pair.swapped_params]
    give_grads(case, pair.swapped, pair.swapped_params, pair.steps_taken)
    _expect_error(SwapStateError, rf"parameter {index}\b.*{re.escape(words)}", pair.swapped.step)
    for position, (param, saved) in enumerate(zip(pair.swapped_params, before_params, strict=True)):
        assert_bitwise_equal(saved, param, f"{case.name}: parameter {position} after a refused step")
    pair.swapped.load_state_dict(through_torch_save(good))
    pair.reference.load_state_dict(through_torch_save(good))
    pair.step_both(2)
    pair.assert_equal(f"{case.name}: after a good checkpoint replaced the refused one")


def check_hooks_and_schedulers_before_wrapping(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """A step post-hook and an LR scheduler attached to the plain optimizer before wrapping keep working."""
    reference_params, swapped_params = make_params(case, backend.device), make_params(case, backend.device)
    reference = case.make_optimizer(make_groups(case, reference_params))
    plain = case.make_optimizer(make_groups(case, swapped_params))
    calls: list[int] = []
    plain.register_step_post_hook(lambda optimizer, args, kwargs: calls.append(1))
    schedulers = [
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) for optimizer in (reference, plain)
    ]
    pair = Pair(
        case,
        reference_params,
        reference,
        swapped_params,
        wrap_case(case, plain, swap_config(case, backend, **overrides)),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            pair.step_both()
            for scheduler in schedulers:
                scheduler.step()
    assert len(calls) == 3, f"{case.name}: the post-hook registered before wrapping ran {len(calls)} of 3 times"
    messages = [str(warning.message) for warning in caught if "lr_scheduler.step()" in str(warning.message)]
    assert not messages, f"{case.name}: the scheduler built before wrapping warned: {messages}"
    pair.assert_equal(f"{case.name}: 3 scheduled steps")


def check_second_wrapper(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """Wrapping an optimizer that a live SwapOptimizer already wraps is refused; the first goes on unharmed."""
    pair = make_pair(case, backend, **overrides)
    pair.step_both(1)
    _expect_error(
        UnsupportedOptimizerError,
        "already wrapped by a SwapOptimizer",
        lambda: wrap_case(case, pair.swapped.optimizer, swap_config(case, backend, **overrides)),
    )
    pair.step_both(2)
    pair.assert_equal(f"{case.name}: after a refused second wrapper")


def check_bypassed_overrides(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """A subclass overriding ``step``, or an instance with a replaced ``step``, is refused by adapters that
    reproduce the family's math (they would never run the override)."""
    pair = make_pair(case, backend, **overrides)
    if not pair.swapped.adapter.reproduces:
        return  # an adapter that runs the optimizer's own step runs the override too (parity checks cover it)
    plain = case.make_optimizer(make_groups(case, make_params(case, backend.device)))
    family = type(plain)

    def clamping_step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.clamp_(-0.1, 0.1)
        return family.step(self, closure)

    subclass = type(f"Clamping{family.__name__}", (family,), {"step": clamping_step})
    plain.__class__ = subclass
    _expect_error(
        UnsupportedOptimizerError,
        f"Clamping{family.__name__} overrides step",
        lambda: wrap_case(case, plain, swap_config(case, backend, **overrides)),
    )
    _assert_never_wrapped(plain, f"{case.name}: refused for an overridden step")
    patched = case.make_optimizer(make_groups(case, make_params(case, backend.device)))
    patched.step = functools.partial(_no_step, patched)  # type: ignore[method-assign,assignment]
    _expect_error(
        UnsupportedOptimizerError,
        "step was replaced on the instance",
        lambda: wrap_case(case, patched, swap_config(case, backend, **overrides)),
    )
    _assert_never_wrapped(patched, f"{case.name}: refused for a replaced step")


HABIT_CHECKS: dict[str, HabitCheck] = {
    "state_resets": check_state_resets,
    "late_first_gradient": check_late_first_gradient,
    "state_edits_in_place": check_state_edits_in_place,
    "edited_param_groups": check_edited_param_groups,
    "duplicate_params": check_duplicate_params,
    "empty_optimizer": check_empty_optimizer,
    "deepcopy_and_pickle": check_deepcopy_and_pickle,
    "load_through_the_wrapped_optimizer": check_load_through_the_wrapped_optimizer,
    "incomplete_checkpoints": check_incomplete_checkpoints,
    "hooks_and_schedulers_before_wrapping": check_hooks_and_schedulers_before_wrapping,
    "second_wrapper": check_second_wrapper,
    "bypassed_overrides": check_bypassed_overrides,
}
"""Every habit check by name: the conformance suite runs each for every case."""


# -- edits and resets ----------------------------------------------------------
def _halve_a_swapped_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Replace a large state tensor of the first parameter with state by a new tensor of half its values."""
    for param in params:
        entry = optimizer.state.get(param, {})
        for key, value in flat_items(entry, nested=True):  # a value of a nested dict too, by its path
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() >= 64:
                container, leaf = located(entry, key)
                with torch.no_grad():
                    container[leaf] = value * 0.5
                return
    raise AssertionError("no state tensor large enough to be swapped")


def _with_a_twin_shape(case: ConformanceCase) -> ConformanceCase:
    """The case with one more parameter, shaped like its first: two same-shaped states to mix up."""
    import dataclasses

    return dataclasses.replace(case, shapes=(*case.shapes, case.shapes[0]))


def _swap_first_and_last(optimizer: torch.optim.Optimizer) -> None:
    params = optimizer.param_groups[0]["params"]
    params[0], params[-1] = params[-1], params[0]


def _new_param(case: ConformanceCase, like: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(4242)
    values = torch.randn(case.shapes[0], generator=generator).to(case.dtypes[0])
    return torch.nn.Parameter(values.to(like.device))


def _append_a_param(pair: Pair, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    new = _new_param(pair.case, params[0])
    optimizer.param_groups[0]["params"].append(new)
    params.append(new)


def _drop_a_param(pair: Pair, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Remove the second parameter of group 0 and its state (torch's state_dict refuses a state without a group)."""
    dropped = optimizer.param_groups[0]["params"].pop(1)
    optimizer.state.pop(dropped, None)


def _add_a_group_through_the_wrapped_optimizer(
    pair: Pair, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
) -> None:
    new = _new_param(pair.case, params[0])
    optimizer.add_param_group({"params": [new]})
    params.append(new)


# -- helpers --------------------------------------------------------------------
def _no_step(optimizer: torch.optim.Optimizer, closure: Any = None) -> None:
    """What a patched ``step`` may do instead of the family's update."""


def _expect_error(error: type[BaseException], pattern: str, call: Callable[[], object]) -> None:
    try:
        call()
    except error as raised:
        assert re.search(pattern, str(raised)), f"{type(raised).__name__} says {raised!s:.500}, expected /{pattern}/"
    else:
        raise AssertionError(f"expected {error.__name__} matching /{pattern}/, nothing was raised")


def _assert_never_wrapped(optimizer: torch.optim.Optimizer, context: str) -> None:
    """A refused wrap left the plain optimizer as it was: its own state mapping, no hook of swap's."""
    assert not isinstance(optimizer.state, TrackedState), f"{context}: the state mapping was replaced"
    for name, hooks in hook_registries(optimizer).items():
        assert not any(getattr(hook, "_swap_core_hook", False) for hook in hooks.values()), f"{context}: {name}"


def _snapshot(pair: Pair) -> dict[str, Any]:
    pair.swapped.synchronize()
    params = [param.detach().clone() for param in pair.swapped_params]
    return {"params": params, "state_dict": copy.deepcopy(pair.swapped.state_dict())}


def _assert_unchanged(pair: Pair, before: dict[str, Any], context: str) -> None:
    for index, (saved, param) in enumerate(zip(before["params"], pair.swapped_params, strict=True)):
        assert_bitwise_equal(saved, param, f"{pair.case.name} {context}: parameter {index}")
    assert_state_dicts_equal(before["state_dict"], pair.swapped.state_dict(), f"{pair.case.name} {context}")


def _last_swapped_key(state_dict: dict[str, Any]) -> tuple[int, str]:
    """The last parameter with state, and one of its large (swapped) tensor keys."""
    for index in sorted(state_dict["state"], reverse=True):
        for key, value in flat_items(state_dict["state"][index], nested=True):
            if isinstance(value, torch.Tensor) and value.numel() >= 64:
                return index, key
    raise AssertionError("no swapped state in the checkpoint")
