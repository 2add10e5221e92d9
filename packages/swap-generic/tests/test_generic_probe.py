"""The wrap-time probe: what it refuses, before anything changes, and what it accepts.

Each optimizer below is a small one written for these tests, standing for a class of real ones (not a copy of any).
A refusal must leave the optimizer exactly as it was (parameters, states, param group values) and the global RNG
too; an acceptance must step bitwise as the plain optimizer.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.errors import HostMemoryError, UnsupportedOptimizerError
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_generic import GenericAdapter

SHAPES = ((24, 40), (40,), (16, 20), (8, 8))


def _params(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _config(**options: Any) -> SwapConfig:
    return SwapConfig(**{"backend": SimBackend(mode="lazy"), "swap_times": 2, "min_numel": 16, **options})


class _PlainSGD(torch.optim.Optimizer):
    """Per-parameter SGD with momentum: the base of the doubles below."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def _update(self, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor) -> None:
        state = self.state[param]
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(param)
        state["momentum"].mul_(0.9).add_(grad)
        param.add_(state["momentum"], alpha=-group["lr"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(group, param, param.grad)
        return None


class ClippingInsideStep(_PlainSGD):
    """Clips the group's gradients by their global norm inside its step (gradient clipping built in)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            torch.nn.utils.clip_grad_norm_(group["params"], max_norm=10.0)
        return super().step(closure)


class SkipsOnNonFinite(_PlainSGD):
    """Changes nothing when any gradient is not finite (as a loss-scaling optimizer does)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        grads = [param.grad for group in self.param_groups for param in group["params"] if param.grad is not None]
        if not all(bool(torch.isfinite(grad).all()) for grad in grads):
            return None
        return super().step(closure)


class GroupStatistic(_PlainSGD):
    """Writes a group-wide statistic into its group each step and scales by it (D-Adaptation-like step sizes)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            norms = [param.grad.norm() for param in group["params"] if param.grad is not None]
            group["grad_norm"] = float(torch.stack(norms).norm()) if norms else 0.0
        return super().step(closure)


class AddsAGroup(_PlainSGD):
    """Adds a param group inside its step."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        super().step(closure)
        if len(self.param_groups) < 3:
            self.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
        return None


class ListState(_PlainSGD):
    """Keeps a list of tensors in each parameter's state (a history)."""

    def _update(self, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor) -> None:
        super()._update(group, param, grad)
        self.state[param].setdefault("history", []).append(grad.clone())


class GlobalCounter(_PlainSGD):
    """Counts steps in an entry of ``optimizer.state`` that belongs to no parameter, and uses it."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.state["total_step"] = self.state.get("total_step", 0) + 1
        for group in self.param_groups:
            group_lr = group["lr"] / self.state["total_step"]
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group_lr)
        return None


class CountsOnly(_PlainSGD):
    """Counts steps in an entry of ``optimizer.state`` that belongs to no parameter (read by nobody yet)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.state["total_step"] = self.state.get("total_step", 0) + 1
        return super().step(closure)


class PairedByPosition(_PlainSGD):
    """Updates parameters in pairs by their position in a group (A and B of a low-rank adapter together)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            params = [param for param in group["params"] if param.grad is not None]
            for first, second in zip(params[0::2], params[1::2], strict=False):
                scale = first.grad.norm() + second.grad.norm()
                first.add_(first.grad / scale, alpha=-group["lr"])
                second.add_(second.grad / scale, alpha=-group["lr"])
        return None


class NeedsTheClosure(_PlainSGD):
    """Needs the closure (a step size from the loss, as AliG- or SAM-style optimizers do)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if closure is None:
            raise RuntimeError("NeedsTheClosure requires closure, but it was not passed")
        return super().step(closure)


class RandomInitialState(_PlainSGD):
    """Draws each parameter's initial state from the global RNG (per-parameter all the same)."""

    def _update(self, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor) -> None:
        state = self.state[param]
        if "momentum" not in state:
            state["momentum"] = torch.randn_like(param) * 1e-3
        super()._update(group, param, grad)


class DrivenOutsideStep(_PlainSGD):
    """Updates each parameter in its own backward method (a LOMO-style fused backward); ``step()`` is not supported."""

    swap_per_parameter = True  # even declared: it has no step to batch

    def fused_backward(self, loss: torch.Tensor, lr: float) -> None:
        loss.backward()

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        raise NotImplementedError("DrivenOutsideStep updates parameters in fused_backward(loss, lr), not in step()")


class HessianFromGradients(_PlainSGD):
    """Scales each update by a curvature estimate from a Hessian-vector product through the gradients' graph (as
    AdaHessian- or Sophia-style optimizers do after ``loss.backward(create_graph=True)``)."""

    retain_graph = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        params = [param for group in self.param_groups for param in group["params"] if param.grad is not None]
        if not params:
            return None
        grads = [param.grad for param in params]
        probes = [torch.randint_like(param, 2) * 2 - 1 for param in params]
        products = torch.autograd.grad(grads, params, grad_outputs=probes, retain_graph=self.retain_graph)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                where = next(index for index, other in enumerate(params) if other is param)
                curvature = (products[where] * probes[where]).abs() + 1e-3
                param.add_(param.grad.detach() / curvature, alpha=-group["lr"])
        return None


class HessianKeepingTheGraph(HessianFromGradients):
    """The same with ``retain_graph=True``: every batch runs, but each reads a Hessian without its cross terms."""

    retain_graph = True


REFUSED = {
    "clipping inside the step": (ClippingInsideStep, r"large gradients"),
    "skipping on a non-finite gradient": (SkipsOnNonFinite, r"a non-finite gradient in one parameter"),
    "a group-wide statistic in the group": (GroupStatistic, r"wrote param group 0's 'grad_norm' as"),
    "a param group added by the step": (AddsAGroup, r"one at a time failed where .* did not .*changed param_groups"),
    "a list in the state": (ListState, r"keeps state 'history' as a list"),
    "a counter outside the parameters' entries": (GlobalCounter, r"gave different values"),
    "a counter outside the parameters' entries, unused": (CountsOnly, r"entries of optimizer.state that belong to no"),
    "parameters paired by position": (PairedByPosition, r"gave different values"),
    "a step that needs the closure": (NeedsTheClosure, r"could not check .* requires closure.*swap_per_parameter"),
    "an optimizer driven outside step()": (
        DrivenOutsideStep,
        r"its step\(\) is not implemented \(.*fused_backward\(loss, lr\).*driven outside step\(\)",
    ),
    "a step that runs autograd through the gradients": (
        HessianFromGradients,
        r"cannot run batch by batch: .*backward through the graph a second time.*carrying their graph",
    ),
    "a step that runs autograd through the gradients, keeping the graph": (
        HessianKeepingTheGraph,
        r"not per-parameter: .*gave different values.*carrying their graph",
    ),
}


def _snapshot(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> tuple[Any, ...]:
    groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    return [param.detach().clone() for param in params], dict(optimizer.state), groups, torch.random.get_rng_state()


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_step_that_is_not_per_parameter_is_refused_before_anything_changes(name: str) -> None:
    cls, words = REFUSED[name]
    params = _params()
    for param in params:
        param.grad = torch.randn_like(param)
    plain = cls(params)
    before = _snapshot(plain, params)
    with pytest.raises(UnsupportedOptimizerError, match=words):
        swap_optimizer(plain, _config())
    values, state, groups, rng = _snapshot(plain, params)
    for index, (expected, actual) in enumerate(zip(before[0], values, strict=True)):
        assert_bitwise_equal(expected, actual, f"{name}: parameter {index}")
    assert state == before[1] == {} and groups == before[2], f"{name}: the optimizer changed"
    assert torch.equal(rng, before[3]), f"{name}: the probe moved the global RNG"


def test_an_optimizer_drawing_its_states_at_random_is_per_parameter_and_leaves_the_rng_alone() -> None:
    params, reference_params = _params(), _params()
    torch.manual_seed(7)
    swapped = swap_optimizer(RandomInitialState(params), _config())
    reference = RandomInitialState(reference_params)
    torch.manual_seed(7)  # the wrap consumed nothing: both draw the same states
    for step in range(4):
        generator = torch.Generator().manual_seed(step)
        for param, reference_param in zip(params, reference_params, strict=True):
            grad = torch.randn(param.shape, generator=generator)
            param.grad, reference_param.grad = grad.clone(), grad.clone()
        state = torch.random.get_rng_state()
        reference.step()
        torch.random.set_rng_state(state)
        swapped.step()
    for index, (expected, actual) in enumerate(zip(reference_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")


def test_a_declaration_settles_what_the_probe_cannot_tell_or_would_refuse() -> None:
    class DeclaredPerParameter(NeedsTheClosure):
        swap_per_parameter = True

    swapped = swap_optimizer(DeclaredPerParameter(_params()), _config())
    assert isinstance(swapped.adapter, GenericAdapter)

    class DeclaredButFailsApart(HessianFromGradients):
        swap_per_parameter = True  # no declaration makes the second batch not raise

    with pytest.raises(UnsupportedOptimizerError, match=r"cannot run batch by batch"):
        swap_optimizer(DeclaredButFailsApart(_params()), _config())

    class DeclaredCoupled(_PlainSGD):
        swap_per_parameter = False

    with pytest.raises(UnsupportedOptimizerError, match=r"declares its step not per-parameter"):
        swap_optimizer(DeclaredCoupled(_params()), _config())


def test_a_state_key_the_optimizer_never_creates_is_refused_naming_the_ones_it_does() -> None:
    plain = torch.optim.SGD(_params(), lr=0.1, momentum=0.9)
    with pytest.raises(
        ValueError, match=r"Unknown state_keys \['momentum'\] for SGD; swappable keys are \['momentum_buffer'\]"
    ):
        swap_optimizer(plain, _config(state_keys=("momentum",)))
    swapped = swap_optimizer(plain, _config(state_keys=("momentum_buffer",)))
    assert swapped.config.state_keys == ("momentum_buffer",)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_a_first_step_whose_states_the_host_cannot_take_is_refused_before_any_batch(packed: bool) -> None:
    """The first step creates SGD's momentum buffers; the probe knows they are shaped like their parameters, so
    the host's room is checked before the first batch updates anything (the step used to fail at its last batch,
    every parameter updated, and a retry stepped them twice)."""
    params = [torch.nn.Parameter(torch.randn(256, 256, generator=torch.Generator().manual_seed(i))) for i in range(4)]
    twin = [param.detach().clone() for param in params]
    sim = SimBackend(mode="lazy", host_bytes=3 * 256 * 256 * 4)
    swapped = swap_optimizer(
        torch.optim.SGD(params, lr=0.1, momentum=0.9), SwapConfig(backend=sim, swap_times=4, packed=packed)
    )
    for param in params:
        param.grad = torch.ones_like(param)
    with pytest.raises(HostMemoryError, match=r"Nothing was allocated"):
        swapped.step()
    for index, (expected, actual) in enumerate(zip(twin, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} after the refused step")
    assert not any(swapped.state.get(param) for param in params), "no state was created"
    assert sim.host_pinned_bytes() == 0


def test_states_of_another_size_are_not_counted_against_the_host() -> None:
    """A factored moment (Adafactor's row and column statistics) has no size the probe can tell from stand-ins: the
    check counts only states shaped like their parameter, so it never refuses what would fit."""
    params = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(2)]
    sim = SimBackend(mode="lazy", host_bytes=64 * 1024)  # room for the factored statistics, not for full moments
    swapped = swap_optimizer(torch.optim.Adafactor(params, lr=0.01), SwapConfig(backend=sim, min_numel=16))
    for param in params:
        param.grad = torch.ones_like(param)
    swapped.step()
    assert set(swapped.state[params[0]]) == {"step", "row_var", "col_var"}


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adagrad, torch.optim.NAdam, torch.optim.ASGD])
def test_differentiable_is_refused_at_wrap_time_as_for_every_family(cls: type[torch.optim.Optimizer]) -> None:
    """differentiable=True needs the states in autograd's graph from step to step; swapping copies them to host
    memory and back in between (Adam, AdamW and RMSprop refuse it the same way)."""
    params = _params()
    plain = cls(params, lr=0.01, differentiable=True)
    made = {id(param): set(state) for param, state in plain.state.items()}  # Adagrad's constructor makes its sums
    with pytest.raises(UnsupportedOptimizerError, match=r"differentiable=True in param group 0 cannot be swapped"):
        swap_optimizer(plain, _config())
    assert {id(param): set(state) for param, state in plain.state.items()} == made


class RaisesOnLargeParameters(_PlainSGD):
    """Counts its steps in the group (as schedule-free optimizers do) and raises on a parameter larger than a limit:
    a check only the real parameters trip (the probe's stand-ins are small), so it raises in a later batch."""

    limit = 1000

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, lr)
        for group in self.param_groups:
            group["k"] = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            group["k"] += 1
            for param in group["params"]:
                if param.numel() > self.limit:
                    raise ValueError(f"a parameter of {param.numel()} elements is over the limit of {self.limit}")
        return super().step(closure)


def _limit_params() -> list[torch.Tensor]:
    """Parameters for :class:`RaisesOnLargeParameters`: the last, over its limit, is in the last of three batches."""
    generator = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((8, 8), (16, 20), (48, 40))]


def _limit_grads(params: list[torch.Tensor], step: int) -> None:
    generator = torch.Generator().manual_seed(50 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


@pytest.mark.parametrize("mode", ["lazy", "random"])
def test_an_error_of_the_optimizers_own_code_in_a_later_batch_of_a_first_step_leaves_everything_as_before(
    mode: str,
) -> None:
    swapped_params, twin_params = _limit_params(), _limit_params()
    swapped = swap_optimizer(
        RaisesOnLargeParameters(swapped_params),
        SwapConfig(backend=SimBackend(mode=mode, seed=2), swap_times=3, min_numel=16),
    )
    before = _snapshot(swapped.optimizer, swapped_params)
    _limit_grads(swapped_params, 0)
    with pytest.raises(ValueError, match="over the limit"):
        swapped.step()
    values, state, groups, _ = _snapshot(swapped.optimizer, swapped_params)
    for index, (expected, actual) in enumerate(zip(before[0], values, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} after the failed step")
    assert not any(state.values()) and groups == before[2] == [{"lr": 0.1, "k": 0}], (state, groups)
    # It goes on as a twin that never saw the failed step.
    twin = RaisesOnLargeParameters(twin_params)
    twin.limit = swapped.optimizer.limit = 10_000  # type: ignore[attr-defined]
    for step in range(3):
        for values, optimizer in ((swapped_params, swapped), (twin_params, twin)):
            _limit_grads(values, step)
            optimizer.step()
    for index, (expected, actual) in enumerate(zip(twin_params, swapped_params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} 3 steps after the failed one")
    assert swapped.param_groups[0]["k"] == twin.param_groups[0]["k"] == 3


@pytest.mark.parametrize("mode", ["lazy", "random"])
def test_with_undo_failed_steps_an_error_of_the_optimizers_own_code_in_a_later_step_leaves_everything_as_before(
    mode: str,
) -> None:
    swapped_params, twin_params = _limit_params(), _limit_params()
    plain = RaisesOnLargeParameters(swapped_params)
    config = SwapConfig(backend=SimBackend(mode=mode, seed=2), swap_times=3, min_numel=16, undo_failed_steps=True)
    swapped = swap_optimizer(plain, config)
    twin = RaisesOnLargeParameters(twin_params)
    twin.limit = plain.limit = 10_000
    for step in range(2):
        for values, optimizer in ((swapped_params, swapped), (twin_params, twin)):
            _limit_grads(values, step)
            optimizer.step()
    plain.limit = 1000  # the step of a later batch raises now
    before = [param.detach().clone() for param in swapped_params]
    checkpoint = copy.deepcopy(swapped.state_dict())
    _limit_grads(swapped_params, 2)
    with pytest.raises(ValueError, match="over the limit"):
        swapped.step()
    for index, (expected, actual) in enumerate(zip(before, swapped_params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} after the failed step")
    assert_state_dicts_equal(checkpoint, swapped.state_dict(), "the state and group values after the failed step")
    assert swapped.param_groups[0]["k"] == 2
    plain.limit = 10_000
    for step in range(2, 4):
        for values, optimizer in ((swapped_params, swapped), (twin_params, twin)):
            _limit_grads(values, step)
            optimizer.step()
    for index, (expected, actual) in enumerate(zip(twin_params, swapped_params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} 2 steps after the failed one")
    assert_state_dicts_equal(twin.state_dict(), swapped.state_dict(), "2 steps after the failed one")
