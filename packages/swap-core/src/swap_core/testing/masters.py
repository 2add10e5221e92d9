"""The reference a master-weights optimizer is held to, bitwise: the plain optimizer over fp32 masters.

``SwapConfig(master_weights=True)`` promises the numbers of this loop, which is what a user without
swap writes for fp32 master weights::

    masters = [p.detach().float() for p in params]        # leaf copies
    optimizer = torch.optim.AdamW(masters, ...)
    # each step:
    for p, m in zip(params, masters): m.grad = p.grad.float()
    optimizer.step()
    for p, m in zip(params, masters): p.copy_(m)           # round to nearest even

:class:`MasterReference` is that loop, for any optimizer factory; fp32 parameters are stepped as
they are (they keep no master).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..backends.protocol import DeviceBackend
from ..dtensor import shard_layout
from ..master_weights.fp32_view import with_fp32_master
from ..master_weights.params import has_master
from ..optimizer import SwapOptimizer
from ..runtime.state_keys import MASTER_KEY
from .compare import assert_bitwise_equal, assert_state_dicts_equal
from .pairs import (
    ConformanceCase,
    give_grads,
    make_groups,
    make_params,
    set_grads,
    skips_a_gradient,
    swap_config,
    through_torch_save,
    wrap_case,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "MASTER_DTYPES",
    "MIXED_SHAPES_AND_DTYPES",
    "MasterReference",
    "assert_stepped_in_backward",
    "check_master_weights",
    "mixed_precision_params",
    "set_same_grads",
    "sharded_on",
]

MASTER_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
"""Cycled over a conformance case's parameters by :func:`check_master_weights`: bf16 and fp16 get masters, fp32
keeps none."""

MIXED_SHAPES_AND_DTYPES: tuple[tuple[tuple[int, ...], torch.dtype], ...] = (
    ((32, 40), torch.bfloat16),
    ((40,), torch.bfloat16),  # under a min_numel of 64: its states and master stay resident on the device
    ((24, 24), torch.float32),  # keeps no master
    ((30, 30), torch.float16),
    ((16, 8), torch.bfloat16),
)
"""Parameters the master-weights tests train: bf16, fp16 and fp32, one small enough to stay resident."""


def mixed_precision_params(
    seed: int = 0, shapes_and_dtypes: Sequence[tuple[tuple[int, ...], torch.dtype]] = MIXED_SHAPES_AND_DTYPES
) -> list[torch.nn.Parameter]:
    """Fresh parameters of ``shapes_and_dtypes``, the same values for the same ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape, dtype in shapes_and_dtypes]


def set_same_grads(step: int, *param_sets: Sequence[torch.Tensor]) -> None:
    """The same deterministic gradients for ``step`` on each of ``param_sets`` (lists of parameters of the same
    shapes and dtypes, in the same order), each in its parameter's dtype and, for a DTensor, its sharding."""
    generator = torch.Generator().manual_seed(1_000 + step)
    grads = [torch.randn(param.shape, generator=generator).to(param.dtype) for param in param_sets[0]]
    for params in param_sets:
        for param, grad in zip(params, grads, strict=True):
            param.grad = _sharded_like(param, grad.clone())


def sharded_on(mesh: DeviceMesh, tensors: Sequence[torch.Tensor]) -> list[torch.nn.Parameter]:
    """New DTensor parameters with ``tensors``' values, sharded on their first dimension over ``mesh`` (call it once
    for the swapped run and once for its reference)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return [torch.nn.Parameter(distribute_tensor(tensor.detach(), mesh, [Shard(0)])) for tensor in tensors]


def _sharded_like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` as ``param`` holds it: sharded with its mesh and placements when it is a DTensor."""
    if shard_layout(param) is None:
        return full
    from torch.distributed.tensor import DTensor, distribute_tensor

    assert isinstance(param, DTensor)
    return distribute_tensor(full, param.device_mesh, param.placements)


class MasterReference:
    """A plain optimizer over fp32 leaf copies of the low-precision ``params``, stepped as above."""

    def __init__(
        self, params: Sequence[torch.Tensor], make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    ) -> None:
        self.params = list(params)
        self.masters = [param.detach().float() if has_master(param) else param for param in self.params]
        for master, param in zip(self.masters, self.params, strict=True):
            if master is not param:
                master.requires_grad_(param.requires_grad)
        self.optimizer = make_optimizer(self.masters)
        self._stepped: set[int] = set()
        """Indices of the masters stepped with a gradient (a swapped optimizer holds those masters in its state)."""

    def set_grads(self, step: int, *others: Sequence[torch.Tensor]) -> None:
        """:func:`set_same_grads` on the reference's parameters and on each of ``others``."""
        set_same_grads(step, self.params, *others)

    def step(self) -> None:
        """Gradients to the masters (upcast), the plain optimizer's step, parameters from the masters."""
        self.copy_grads_to_masters()
        self.optimizer.step()
        self.copy_masters_to_params()

    def copy_grads_to_masters(self) -> None:
        """``m.grad = p.grad.float()`` (the first third of :meth:`step`, for a caller stepping through a GradScaler)."""
        for index, (param, master) in enumerate(zip(self.params, self.masters, strict=True)):
            if master is not param:
                master.grad = None if param.grad is None else param.grad.float()
                if param.grad is not None:
                    self._stepped.add(index)

    def copy_masters_to_params(self) -> None:
        """``p.copy_(m)``, round to nearest even (the last third of :meth:`step`)."""
        with torch.no_grad():
            for param, master in zip(self.params, self.masters, strict=True):
                if master is not param:
                    param.copy_(master)

    def assert_matches(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], where: str) -> None:
        """``params`` (the swapped optimizer's, in this reference's order) and their states in ``optimizer``
        are bitwise the reference's parameters and states, masters included."""
        synchronize = getattr(optimizer, "synchronize", None)
        if callable(synchronize):
            synchronize()
        for index, (expected, actual) in enumerate(zip(self.params, params, strict=True)):
            assert_bitwise_equal(expected, actual, f"{where}: parameter {index}")
            expected_state = self.state_of(expected)
            actual_state = with_fp32_master(actual, optimizer.state.get(actual, {}))  # either form, as fp32
            assert sorted(actual_state) == sorted(expected_state), (
                f"{where}: parameter {index} has state keys {sorted(actual_state)}, expected {sorted(expected_state)}"
            )
            for key, value in expected_state.items():
                if isinstance(value, dict):  # a nested dict of tensors and numbers
                    assert_state_dicts_equal(
                        {"param_groups": [], "state": value},
                        {"param_groups": [], "state": actual_state[key]},
                        f"{where}: {key!r} of parameter {index}",
                    )
                elif isinstance(value, torch.Tensor):
                    assert_bitwise_equal(value, actual_state[key], f"{where}: {key!r} of parameter {index}")
                else:  # a number (bitsandbytes keeps its step count as an int)
                    assert actual_state[key] == value, f"{where}: {key!r} of parameter {index} is {actual_state[key]!r}"

    def state_of(self, param: torch.Tensor) -> dict[str, Any]:
        """The reference optimizer's state of ``param`` (of its master), with the master under ``"master_param"``
        once it has a state or was stepped (an optimizer that keeps no state, as plain SGD, still keeps the master)."""
        index = next(index for index, known in enumerate(self.params) if known is param)
        master = self.masters[index]
        state = dict(self.optimizer.state.get(master, {}))
        if master is not param and (state or index in self._stepped):
            state[MASTER_KEY] = master.detach()
        return state


def check_master_weights(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """With ``master_weights=True`` over bf16, fp16 and fp32 parameters: bitwise the plain optimizer over fp32
    masters (:class:`~swap_core.testing.masters.MasterReference`) after every step, masters and states included;
    then a deep copy (of the model and the optimizer together, where the plain optimizer survives one) and a
    checkpoint through ``torch.save``, loaded into a newly wrapped optimizer, each go on as the reference does."""
    mixed = dataclasses.replace(case, dtypes=MASTER_DTYPES)
    reference = MasterReference(
        make_params(mixed, backend.device), lambda masters: case.make_optimizer(make_groups(case, masters))
    )
    params = make_params(mixed, backend.device)
    config = swap_config(case, backend, **{**overrides, "master_weights": True})
    swapped = wrap_case(case, case.make_optimizer(make_groups(case, params)), config)
    half = case.steps // 2
    _train_on_masters(mixed, reference, swapped, params, range(half), case.name)
    if case.deep_copies:
        twin_reference = copy.deepcopy(reference)
        twin_params, twin = copy.deepcopy((params, swapped))
        _train_on_masters(mixed, twin_reference, twin, twin_params, range(half, half + 2), f"{case.name} deep copy")
    restored_params = [torch.nn.Parameter(param.detach().clone()) for param in params]
    restored = wrap_case(case, case.make_optimizer(make_groups(case, restored_params)), config)
    restored.load_state_dict(through_torch_save(swapped.state_dict()))
    _train_on_masters(mixed, reference, restored, restored_params, range(half, case.steps), f"{case.name} restored")
    races = getattr(backend, "races", [])
    assert not races, f"{case.name}: the simulator reported races: {races}"


def _train_on_masters(
    case: ConformanceCase,
    reference: MasterReference,
    swapped: SwapOptimizer,
    params: Sequence[torch.Tensor],
    steps: range,
    where: str,
) -> None:
    for step in steps:
        set_grads(case, reference.params, step)
        give_grads(case, swapped, params, step)
        reference.step()
        swapped.step()
        reference.assert_matches(swapped, params, f"{where}, master weights, step {step}")
        if step > steps.start and not skips_a_gradient(case, step):
            assert_stepped_in_backward(swapped, f"{where}, master weights, step {step}")


def assert_stepped_in_backward(optimizer: SwapOptimizer, where: str) -> None:
    """With ``SwapConfig(step="in_backward")``, after a step whose backward gave every parameter a gradient and
    followed a step over the same states: every batch updated inside that backward (nothing otherwise)."""
    stats = optimizer.stats
    if optimizer.config.step == "in_backward":
        assert stats.batches_in_backward == stats.batches, (
            f"{where}: {stats.batches_in_backward} of {stats.batches} batches updated inside the backward"
        )
