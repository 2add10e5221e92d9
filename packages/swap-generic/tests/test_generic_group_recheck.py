"""A coupling switched on after wrapping is probed again before the next step (issue 44, item 4).

The optimizer clips each group's gradients by their total norm when the group's ``clip_norm`` is set: a coupling
of every parameter of the group, which run batch by batch clips each batch by its own norm. Wrapped with it off,
it is per-parameter and swapped; switched on by a group option, or by a group added with it, the step is refused
before any batch, naming the switch, and the optimizer goes on as a never-wrapped twin once it is switched off.
Before: the switch was never re-checked, and the swapped steps clipped per batch, silently wrong.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.errors import UnsupportedOptimizerError
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_generic.group_recheck import group_switch, snapshot

SHAPES = ((16, 20), (8, 8), (30, 12), (40,))


class ClipsWhenAsked(torch.optim.SGD):
    """SGD with momentum that first clips each group's gradients to a total norm of ``clip_norm`` when it is set."""

    def __init__(self, params: Any, clip_norm: float | None = None) -> None:
        super().__init__(params, lr=0.05, momentum=0.9)
        for group in self.param_groups:
            group.setdefault("clip_norm", clip_norm)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            with_grad = [param for param in group["params"] if param.grad is not None]
            if group["clip_norm"] is not None and with_grad:
                total_norm = torch.nn.utils.get_total_norm([param.grad for param in with_grad])
                torch.nn.utils.clip_grads_with_norm_(with_grad, group["clip_norm"], total_norm, foreach=False)
        return super().step(closure)


def _params(shapes: tuple[tuple[int, ...], ...] = SHAPES) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def _step(pairs: list[tuple[list[torch.Tensor], torch.optim.Optimizer]], steps: range) -> None:
    for step in steps:
        for params, optimizer in pairs:
            generator = torch.Generator().manual_seed(100 + step)
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator) * 10
            optimizer.step()


def _assert_as_twin(
    params: list[torch.Tensor], swapped: SwapOptimizer, twin_params: list[torch.Tensor], twin: Any
) -> None:
    for index, (expected, actual) in enumerate(zip(twin_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert_state_dicts_equal(twin.state_dict(), swapped.state_dict(), "the state dict")


def _switch_option(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    optimizer.param_groups[0]["clip_norm"] = 1.0
    return lambda: optimizer.param_groups[0].__setitem__("clip_norm", None)


def _add_group(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    params.append(torch.nn.Parameter(torch.ones(12, 12)))
    optimizer.add_param_group({"params": [params[-1]], "clip_norm": 1.0})
    return lambda: optimizer.param_groups[1].__setitem__("clip_norm", None)


SWITCHES = {
    "group_option": (_switch_option, r"param group 0's 'clip_norm' changed from None to 1\.0"),
    "add_param_group": (_add_group, r"param group 1 was added \(with \{.*'clip_norm': 1\.0"),
}


@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_a_coupling_switched_on_after_wrapping_is_refused_before_any_batch(switch: str) -> None:
    switch_on, message = SWITCHES[switch]
    twin_params, params = _params(), _params()
    twin = ClipsWhenAsked(twin_params)
    config = SwapConfig(backend=SimBackend(mode="random", seed=5), swap_times=3, min_numel=32)
    swapped = swap_optimizer(ClipsWhenAsked(params), config)  # clip_norm None: per-parameter, accepted
    pairs = [(twin_params, twin), (params, swapped)]
    _step(pairs, range(2))
    switch_on(twin_params, twin)
    switch_off = switch_on(params, swapped.optimizer)
    before = [param.detach().clone() for param in params]
    checkpoint = copy.deepcopy(swapped.state_dict())
    with pytest.raises(UnsupportedOptimizerError, match=message + r".*not per-parameter.*set the value back"):
        _step([(params, swapped)], range(2, 3))
    for index, (expected, actual) in enumerate(zip(before, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} after the refused step")
    assert_state_dicts_equal(checkpoint, swapped.state_dict(), "after the refused step")
    switch_off()  # as the error says: both go on without the clip
    twin.param_groups[-1]["clip_norm"] = None
    _step(pairs, range(3, 6))
    _assert_as_twin(params, swapped, twin_params, twin)


def test_a_group_added_without_the_coupling_and_a_scheduled_lr_step_as_the_twin() -> None:
    twin_params, params = _params(), _params()
    twin = ClipsWhenAsked(twin_params)
    swapped = swap_optimizer(
        ClipsWhenAsked(params), SwapConfig(backend=SimBackend(mode="lazy"), swap_times=3, min_numel=32)
    )
    pairs = [(twin_params, twin), (params, swapped)]
    schedulers = [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) for _, optimizer in pairs]
    for step in range(4):
        _step(pairs, range(step, step + 1))
        for scheduler in schedulers:
            scheduler.step()
    for twin_or_swapped_params, optimizer in pairs:
        twin_or_swapped_params.append(torch.nn.Parameter(torch.ones(12, 12)))
        optimizer.add_param_group({"params": [twin_or_swapped_params[-1]], "clip_norm": None, "lr": 0.0})
    _step(pairs, range(4, 7))
    _assert_as_twin(params, swapped, twin_params, twin)


def test_what_counts_as_a_switch() -> None:
    groups = [{"params": [], "lr": 0.1, "betas": (0.9, 0.99), "clip": None, "mode": "a", "flag": False}]
    before = snapshot(groups)
    schedules = {"lr": 0.05, "betas": (0.85, 0.999)}
    assert group_switch(before, [{**groups[0], **schedules}]) is None
    for key, value in {"clip": 1.0, "mode": "b", "flag": True, "lr": 0.0, "betas": (0.9, 0.0)}.items():
        assert group_switch(before, [{**groups[0], key: value}]) is not None, key
    assert group_switch(before, [{**groups[0], "new": 1}]) == "param group 0 gained or lost 'new'"
    assert group_switch(before, []) == "param group 0 was removed"


def test_inside_the_backward_the_switch_is_refused_by_the_backward_before_any_batch() -> None:
    """With ``step="in_backward"`` the batches run inside the backward: the re-probe refuses there, nothing updated,
    and once the option is set back the steps go on inside the backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    config = SwapConfig(backend=SimBackend(mode="random", seed=2), swap_times=2, min_numel=8, step="in_backward")
    swapped = swap_optimizer(ClipsWhenAsked(list(model.parameters())), config)
    inputs = torch.randn(4, 16)

    def train_step() -> None:
        model(inputs).pow(2).sum().backward()
        swapped.step()
        swapped.zero_grad()

    train_step()
    swapped.param_groups[0]["clip_norm"] = 1.0
    before = [param.detach().clone() for param in model.parameters()]
    with pytest.raises(UnsupportedOptimizerError, match=r"'clip_norm' changed from None to 1\.0.*not per-parameter"):
        model(inputs).pow(2).sum().backward()
    for index, (expected, param) in enumerate(zip(before, model.parameters(), strict=True)):
        assert_bitwise_equal(expected, param, f"parameter {index} after the refused backward")
    swapped.param_groups[0]["clip_norm"] = None
    swapped.zero_grad()
    train_step()
    assert swapped.stats.batches_in_backward == swapped.stats.batches == 2


def test_a_re_probe_shares_the_hooks_swap_installed_and_copies_no_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The twins of a re-probe share the state-dict hooks and method redirects a SwapOptimizer installed on the
    wrapped optimizer (they hold the adapter, its host memory and the parameters), and find no parameter in them."""
    from swap_generic import GenericAdapter

    params = _params()
    swapped = swap_optimizer(
        ClipsWhenAsked(params), SwapConfig(backend=SimBackend(mode="lazy"), swap_times=2, min_numel=8)
    )
    _step([(params, swapped)], range(1))

    copies: list[int] = []

    def counted_copy(adapter: GenericAdapter, memo: dict[int, Any]) -> GenericAdapter:
        copies.append(1)  # (a raise here would be swallowed: the sandbox shares what it cannot copy)
        return adapter

    monkeypatch.setattr(GenericAdapter, "__deepcopy__", counted_copy, raising=False)
    swapped.param_groups[0]["lr"] = 0.0  # a truth switch: probed again, accepted
    _step([(params, swapped)], range(1, 2))
    assert copies == []
