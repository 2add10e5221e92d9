"""A step that fails part-way: undone whole where it created every state it updated, else each parameter whole.

The failure is an exception from the update of a later batch (the wrapped optimizer's own code raising), after the
earlier batches were updated and their states copied to host memory.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_lazy_states import LazyMomentumAdapter

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.adapters.base import UpdateBatch
from swap_core.backends.protocol import DeviceBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_core.testing.conformance import through_torch_save
from swap_core.testing.pytest_plugin import BackendFactory
from swap_core.testing.views import planned_batches, planned_resident_params

SHAPES = ((48, 40), (40, 30), (2000,), (8,), (33, 31), (64, 20))
MODES = [("lazy", 0), ("random", 4)]


class OwnCodeFault(RuntimeError):
    """Stands for an exception the wrapped optimizer's own code raises in one batch."""


def _params(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in SHAPES]


def _on(backend: DeviceBackend, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.nn.Parameter(param.detach().to(backend.device)) for param in params]


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype).to(param.device)


def _swapped(
    kind: str, params: list[torch.Tensor], backend: DeviceBackend, packed: bool, *, undo: bool = False
) -> SwapOptimizer:
    config = SwapConfig(
        backend=backend,
        swap_times=3,
        min_numel=64,
        packed=packed,
        master_weights=kind == "masters",
        undo_failed_steps=undo,
    )
    if kind == "lazy":
        return SwapOptimizer(torch.optim.SGD(params, lr=0.05), config, LazyMomentumAdapter)
    return swap_optimizer(torch.optim.RMSprop(params, lr=1e-2, momentum=0.9), config)


def _plain(kind: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if kind == "lazy":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.RMSprop(params, lr=1e-2, momentum=0.9)


class _FailingIn:
    """The optimizer's update raises in batch ``index`` while this is entered."""

    def __init__(self, optimizer: SwapOptimizer, index: int) -> None:
        self.optimizer, self.index = optimizer, index

    def __enter__(self) -> None:
        original = self.optimizer.adapter.update

        def update(batch: UpdateBatch) -> None:
            if batch.batch_index == self.index:
                raise OwnCodeFault(f"the optimizer's own code raised in batch {self.index}")
            original(batch)

        self.optimizer.adapter.update = update  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        del self.optimizer.adapter.update


@pytest.fixture(params=MODES, ids=[f"{mode}{seed}" for mode, seed in MODES])
def backend(request: pytest.FixtureRequest, swap_backend_factory: BackendFactory) -> DeviceBackend:
    mode, seed = request.param
    return swap_backend_factory(mode=mode, seed=seed)


@pytest.mark.parametrize("kind", ["lazy", "eager", "masters"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_a_first_step_failing_in_a_later_batch_is_undone_whole(kind: str, packed: bool, backend: DeviceBackend) -> None:
    dtype = torch.bfloat16 if kind == "masters" else torch.float32
    params, reference_params = _on(backend, _params(dtype)), _on(backend, _params(dtype))
    swapped = _swapped(kind, params, backend, packed)
    never_stepped = through_torch_save(swapped.state_dict())
    before = [param.detach().clone() for param in params]
    _set_grads(params, 0)
    with _FailingIn(swapped, 1), pytest.raises(OwnCodeFault):
        swapped.step()
    for index, (expected, actual) in enumerate(zip(before, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"{kind}: parameter {index} after the failed first step")
    assert_state_dicts_equal(never_stepped, swapped.state_dict(), f"{kind}: state after the failed first step")
    # It goes on as if the failed step never ran: bitwise the plain optimizer (over fp32 masters with masters).
    reference = _plain(kind, _masters(reference_params) if kind == "masters" else reference_params)
    for step in range(3):
        _set_grads(params, step)
        swapped.step()
        grads = _params_grads(reference_params, step)
        for master, grad in zip(reference.param_groups[0]["params"], grads, strict=True):
            master.grad = grad.float()  # with masters the bf16 gradient, as the masters' update reads it
        reference.step()
    expected_params = [master.detach().to(dtype) for master in reference.param_groups[0]["params"]]
    for index, (expected, actual) in enumerate(zip(expected_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"{kind}: parameter {index} 3 steps after the failed one")
    assert not getattr(backend, "races", []), "the simulator reported races"


def _masters(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.nn.Parameter(param.detach().float()) for param in params]


def _params_grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    _set_grads(params, step)
    return [param.grad for param in params if param.grad is not None]


def test_a_later_step_failing_part_way_leaves_each_parameter_whole_and_says_so(backend: DeviceBackend) -> None:
    params = _on(backend, _params())
    swapped = _swapped("eager", params, backend, packed=True)
    for step in range(2):
        _set_grads(params, step)
        swapped.step()
    resident = bool(planned_resident_params(swapped))  # its batch updates first
    batches = len(planned_batches(swapped)) + resident
    _set_grads(params, 2)
    with _FailingIn(swapped, 1), pytest.raises(OwnCodeFault) as raised:
        swapped.step()
    notes: list[Any] = getattr(raised.value, "__notes__", [])
    if hasattr(raised.value, "add_note"):  # Python 3.11+
        assert len(notes) == 1 and f"failed after {1 + resident} of its {batches} batches" in notes[0], notes
        assert "load a checkpoint" in notes[0]


def test_group_values_and_states_of_a_refused_first_step_are_as_before_with_no_batch_left_on_the_device(
    backend: DeviceBackend,
) -> None:
    params = _on(backend, _params())
    swapped = _swapped("lazy", params, backend, packed=True)
    groups = [{key: value for key, value in group.items() if key != "params"} for group in swapped.param_groups]
    _set_grads(params, 0)  # before the count: on a device the gradients are device memory too
    allocated = backend.memory_allocated()
    with _FailingIn(swapped, 2), pytest.raises(OwnCodeFault):
        swapped.step()
    swapped.synchronize()
    assert [{key: value for key, value in group.items() if key != "params"} for group in swapped.param_groups] == groups
    assert not any(swapped.state.get(param) for param in params)
    assert backend.memory_allocated() == allocated, "the failed step left device memory behind"


@pytest.mark.parametrize("kind", ["lazy", "eager", "masters"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("failing", [0, 1, 2])
def test_with_undo_failed_steps_any_step_failing_part_way_is_undone_whole(
    kind: str, packed: bool, failing: int, backend: DeviceBackend
) -> None:
    dtype = torch.bfloat16 if kind == "masters" else torch.float32
    params, reference_params = _on(backend, _params(dtype)), _on(backend, _params(dtype))
    swapped = _swapped(kind, params, backend, packed, undo=True)
    reference = _plain(kind, _masters(reference_params) if kind == "masters" else reference_params)

    def step_reference(step: int) -> None:
        grads = _params_grads(reference_params, step)
        for master, grad in zip(reference.param_groups[0]["params"], grads, strict=True):
            master.grad = grad.float()
        reference.step()

    for step in range(2):
        _set_grads(params, step)
        swapped.step()
        step_reference(step)
    before = [param.detach().clone() for param in params]
    saved = through_torch_save(swapped.state_dict())
    _set_grads(params, 2)
    with _FailingIn(swapped, failing), pytest.raises(OwnCodeFault) as raised:
        swapped.step()
    assert not getattr(raised.value, "__notes__", []), "an undone step needs no note"
    for index, (expected, actual) in enumerate(zip(before, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"{kind}: parameter {index} after the failed step")
    assert_state_dicts_equal(saved, swapped.state_dict(), f"{kind}: state after the failed step")
    for step in range(2, 5):
        _set_grads(params, step)
        swapped.step()
        step_reference(step)
    expected_params = [master.detach().to(dtype) for master in reference.param_groups[0]["params"]]
    for index, (expected, actual) in enumerate(zip(expected_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"{kind}: parameter {index} 3 steps after the undone one")
    assert not getattr(backend, "races", []), "the simulator reported races"
