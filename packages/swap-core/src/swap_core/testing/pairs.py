"""Building blocks of the conformance suite: a case, identical parameter sets, and a reference/swapped pair.

A :class:`Pair` drives the unwrapped optimizer and the swapped one with the same gradients on
separate, identical parameters; every check compares the two bitwise.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from ..adapters.base import AdapterFactory
from ..backends.protocol import DeviceBackend
from ..config import SwapConfig
from ..optimizer import SwapOptimizer
from ..wrap import swap_optimizer
from .compare import assert_bitwise_equal, assert_state_dicts_equal

__all__ = [
    "DEFAULT_SHAPES",
    "BackendFactory",
    "ConformanceCase",
    "OptimizerFactory",
    "Pair",
    "give_grads",
    "make_groups",
    "make_pair",
    "make_params",
    "set_grads",
    "skips_a_gradient",
    "swap_config",
    "through_torch_save",
    "wrap_case",
]

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
BackendFactory = Callable[..., DeviceBackend]

DEFAULT_SHAPES: tuple[tuple[int, ...], ...] = ((48, 40), (40,), (32, 33), (16,), (24, 50), (3, 5), (64, 20))


@dataclasses.dataclass(frozen=True)
class ConformanceCase:
    """One optimizer configuration that must behave, swapped, exactly as unwrapped."""

    name: str
    make_optimizer: OptimizerFactory
    """Builds the plain optimizer from param groups (dicts with ``"params"`` and ``group_options``)."""
    shapes: tuple[tuple[int, ...], ...] = DEFAULT_SHAPES
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    """Cycled over the parameters (several dtypes give several packed regions)."""
    group_options: tuple[Mapping[str, Any], ...] = ({},)
    """One entry per param group; parameters are split into consecutive groups."""
    steps: int = 10
    skip_grad_every: int = 4
    """Every this many steps the first parameter gets no gradient (0: never)."""
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """``SwapConfig`` overrides (``min_numel`` defaults to 64 so that small states stay resident)."""
    adapter_factory: AdapterFactory | None = None
    """The adapter to wrap with (``None``: the registry's, as ``swap_optimizer`` finds it); e.g. the generic
    adapter over Adam, to cross-check it against the dedicated one."""
    deep_copies: bool = True
    """Whether the plain optimizer survives ``copy.deepcopy`` (``False``: torch's ``Optimizer.__getstate__`` keeps
    only ``defaults``, ``state`` and ``param_groups``, and lion_pytorch's ``Lion`` loses an attribute its step
    reads); the checks that copy skip the copy then."""
    device_types: tuple[str, ...] | None = None
    """Device types the optimizer runs on (``None``: any): on another ``--backend`` the case is skipped, naming
    them (torch's fused Adagrad, for one, runs on CPU parameters only)."""

    def __str__(self) -> str:
        return self.name


def make_params(case: ConformanceCase, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    params: list[torch.Tensor] = []
    for index, shape in enumerate(case.shapes):
        dtype = case.dtypes[index % len(case.dtypes)]
        values = torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
        params.append(torch.nn.Parameter(values.to(device)))
    return params


def make_groups(case: ConformanceCase, params: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    count = len(case.group_options)
    size = -(-len(params) // count)
    return [
        {"params": list(params[index * size : (index + 1) * size]), **options}
        for index, options in enumerate(case.group_options)
    ]


def set_grads(
    case: ConformanceCase, params: Sequence[torch.Tensor], step: int, seed: int = 0, *, without: Collection[int] = ()
) -> None:
    """Deterministic gradients for ``step``; the same call gives the same values for any copy of the params.
    ``without``: positions of parameters left without a gradient."""
    for param, grad in zip(params, _grads(case, params, step, seed, without), strict=True):
        param.grad = grad


def give_grads(
    case: ConformanceCase,
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    step: int,
    *,
    without: Collection[int] = (),
) -> None:
    """:func:`set_grads`' gradients to ``params``, the way ``optimizer`` takes them: with ``SwapConfig(step=
    "in_backward")`` through a backward, whose gradient hooks update the batches as they complete (the last
    parameter's gradient is final first, as in a model's backward); else set directly."""
    config = getattr(optimizer, "config", None)
    if not isinstance(config, SwapConfig) or config.step != "in_backward":
        set_grads(case, params, step, without=without)
        return
    grads = _grads(case, params, step, 0, without)
    for param in params:
        param.grad = None
    given = [(param, grad) for param, grad in zip(params, grads, strict=True) if grad is not None]
    # A view's backward hands its input exactly the gradient it gets, in any dtype.
    torch.autograd.backward([param.view_as(param) for param, _ in given], [grad for _, grad in given])


def skips_a_gradient(case: ConformanceCase, step: int) -> bool:
    """Whether the first parameter gets no gradient at ``step`` (every ``case.skip_grad_every`` steps)."""
    return bool(case.skip_grad_every) and step % case.skip_grad_every == case.skip_grad_every - 1


def _grads(
    case: ConformanceCase, params: Sequence[torch.Tensor], step: int, seed: int, without: Collection[int]
) -> list[torch.Tensor | None]:
    generator = torch.Generator().manual_seed(1_000_003 * (seed + 1) + step)
    grads: list[torch.Tensor | None] = []
    for index, param in enumerate(params):
        grad = torch.randn(param.shape, generator=generator, dtype=torch.float32).to(param.dtype)
        skipped = index in without or (index == 0 and skips_a_gradient(case, step))
        grads.append(None if skipped else grad.to(param.device))
    return grads


def swap_config(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> SwapConfig:
    options: dict[str, Any] = {"min_numel": 64, "swap_times": 3}
    options.update(case.config)
    options.update(overrides)
    return SwapConfig(backend=backend, **options)


@dataclasses.dataclass
class Pair:
    """The unwrapped reference optimizer and the swapped one, on separate identical parameters."""

    case: ConformanceCase
    reference_params: list[torch.Tensor]
    reference: torch.optim.Optimizer
    swapped_params: list[torch.Tensor]
    swapped: SwapOptimizer
    steps_taken: int = 0
    max_norm: float | None = None
    """When set, both sides clip their gradients to this total norm (``clip_grad_norm_``) before each step."""

    def step_both(self, count: int = 1) -> None:
        for _ in range(count):
            self.step_reference()
            self.step_swapped()
            self.steps_taken += 1

    def step_reference(self) -> None:
        set_grads(self.case, self.reference_params, self.steps_taken)
        self._clip(self.reference_params)
        self.reference.step()

    def step_swapped(self) -> None:
        give_grads(self.case, self.swapped, self.swapped_params, self.steps_taken)
        self._clip(self.swapped_params)
        self.swapped.step()

    def _clip(self, params: Sequence[torch.Tensor]) -> None:
        if self.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.max_norm)

    def assert_params_equal(self, context: str) -> None:
        for index, (expected, actual) in enumerate(zip(self.reference_params, self.swapped_params, strict=True)):
            assert_bitwise_equal(expected, actual, f"{context}: parameter {index}")

    def assert_equal(self, context: str) -> None:
        self.assert_params_equal(context)
        assert_state_dicts_equal(self.reference.state_dict(), self.swapped.state_dict(), context)


def make_pair(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> Pair:
    reference_params = make_params(case, backend.device)
    swapped_params = make_params(case, backend.device)
    reference = case.make_optimizer(make_groups(case, reference_params))
    plain = case.make_optimizer(make_groups(case, swapped_params))
    swapped = wrap_case(case, plain, swap_config(case, backend, **overrides))
    return Pair(case, reference_params, reference, swapped_params, swapped)


def wrap_case(case: ConformanceCase, optimizer: torch.optim.Optimizer, config: SwapConfig) -> SwapOptimizer:
    """``optimizer`` swapped with the case's adapter (the registry's unless the case names one)."""
    if case.adapter_factory is None:
        return swap_optimizer(optimizer, config)
    return SwapOptimizer(optimizer, config, case.adapter_factory)


def through_torch_save(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` after ``torch.save`` and ``torch.load(weights_only=True)``, as a checkpoint would be."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded
