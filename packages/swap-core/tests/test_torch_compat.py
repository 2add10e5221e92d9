"""The private torch APIs swap-core relies on (``swap_core.torch_compat``) still work on this torch.

Each test fails with the compat function's own message when torch moves what it reads.
"""

from __future__ import annotations

import gc
import importlib
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.optim.optimizer as torch_optimizer

from swap_core.testing.distributed import destroy_process_groups
from swap_core.torch_compat import (
    HOOK_REGISTRIES,
    MODULES_BINDING_THE_DEFAULT_GROUP,
    TorchCompatError,
    TorchDispatchMode,
    current_backward_task,
    hook_registries,
    hook_registries_set_aside,
    import_modules_binding_the_default_group,
    inside_reentrant_backward,
    is_lr_scheduler_step_wrapper,
    op_schema,
    private_function,
    profiler_enabled,
    queue_backward_callback,
    registered_process_groups,
    release_device_mesh_groups,
    share_amp_scaling_support,
    share_hook_registries,
    step_hooks_silenced,
    storage_id,
    tensor_version,
    unscale_gradients_,
)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A gloo group of this process alone, torn down as every distributed test tears down."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        destroy_process_groups()


@pytest.mark.parametrize("name", MODULES_BINDING_THE_DEFAULT_GROUP)
def test_modules_binding_the_default_group_exist(name: str) -> None:
    importlib.import_module(name)


def test_registered_process_groups_lists_the_default_group(one_rank_group: None) -> None:
    assert dist.group.WORLD is not None
    assert registered_process_groups() == [dist.group.WORLD]


def test_importing_the_group_binding_modules_after_init_is_refused(one_rank_group: None) -> None:
    with pytest.raises(RuntimeError, match="must run before init_process_group") as raised:
        import_modules_binding_the_default_group()
    assert "torch.distributed.nn.functional" in str(raised.value)


def test_a_device_mesh_keeps_its_group_until_released() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        world = weakref.ref(mesh.get_group())
    finally:
        dist.destroy_process_group()
    gc.collect()
    try:
        assert world() is not None, "torch's destroy_process_group now frees a mesh's group (torch fixed it?)"
    finally:
        released = release_device_mesh_groups()
    assert released >= 1
    gc.collect()
    assert world() is None
    assert mesh.mesh.tolist() == [0]  # the mesh itself is intact, only its (destroyed) group is gone


def test_teardown_of_one_process_with_a_dtensor() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def gather() -> torch.Tensor:
        mesh = init_device_mesh("cpu", (1,))
        return distribute_tensor(torch.arange(6.0).view(3, 2), mesh, [Shard(0)]).full_tensor()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = weakref.ref(dist.group.WORLD)
    try:
        gathered = gather()
    finally:
        destroy_process_groups()
    assert gathered.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert not dist.is_initialized()
    assert world() is None, "a process group outlived destroy_process_groups()"


def test_hook_registries_are_torch_optimizer_attributes_and_set_aside_restores_them() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    registries = {name: getattr(optimizer, name) for name in HOOK_REGISTRIES}
    assert all(isinstance(hooks, dict) for hooks in registries.values()), "torch moved its hook registries"
    calls: list[str] = []
    optimizer.register_load_state_dict_post_hook(lambda opt: calls.append("post"))
    with hook_registries_set_aside(optimizer, ["_optimizer_load_state_dict_post_hooks"]):
        optimizer.load_state_dict(optimizer.state_dict())
        assert not optimizer._optimizer_load_state_dict_post_hooks
    assert calls == []
    assert all(getattr(optimizer, name) is hooks for name, hooks in registries.items())
    optimizer.load_state_dict(optimizer.state_dict())
    assert calls == ["post"]
    with pytest.raises(ValueError, match=r"Not hook registries of torch\.optim\.Optimizer"):
        with hook_registries_set_aside(optimizer, ["_no_such_hooks"]):
            pass


class _Wrapper(torch.optim.Optimizer):
    """A bare Optimizer subclass that skips torch's __init__ and forwards step, as SwapOptimizer does."""

    def __init__(self, wrapped: torch.optim.Optimizer) -> None:  # no super().__init__: it would re-add the groups
        self.wrapped = wrapped
        self.defaults = wrapped.defaults
        self.param_groups = wrapped.param_groups
        self.state = wrapped.state
        share_hook_registries(self, wrapped)

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        with step_hooks_silenced(self.wrapped):  # this (hooked) step ran the shared hooks already
            self.wrapped.step()


def test_shared_hook_registries_are_the_wrapped_optimizers_own_and_step_is_hooked_once() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    wrapped = torch.optim.SGD([param], lr=0.5)
    calls: list[str] = []
    wrapped.register_step_pre_hook(lambda opt, args, kwargs: calls.append("registered before"))
    wrapper = _Wrapper(wrapped)
    assert all(getattr(wrapper, name) is getattr(wrapped, name) for name in HOOK_REGISTRIES)
    wrapper.register_step_post_hook(lambda opt, args, kwargs: calls.append("registered on the wrapper"))
    param.grad = torch.ones(2)
    wrapper.step()
    assert calls == ["registered before", "registered on the wrapper"], calls
    assert torch.equal(param.detach(), torch.full((2,), 0.5))


def test_shared_hook_registries_are_created_on_an_optimizer_missing_them() -> None:
    wrapped = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.5)
    del wrapped.__dict__["_optimizer_step_pre_hooks"]  # e.g. an optimizer unpickled from an older torch
    wrapper = _Wrapper(wrapped)
    assert wrapper._optimizer_step_pre_hooks is wrapped._optimizer_step_pre_hooks == {}


def test_step_hooks_silenced_empties_instance_and_global_hooks_and_restores_them() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    calls: list[str] = []

    def hook(*_: Any) -> None:
        calls.append("hook")

    handles = [
        optimizer.register_step_pre_hook(hook),
        optimizer.register_step_post_hook(hook),
        torch_optimizer.register_optimizer_step_pre_hook(hook),
        torch_optimizer.register_optimizer_step_post_hook(hook),
    ]
    before = (optimizer._optimizer_step_pre_hooks, torch_optimizer._global_optimizer_pre_hooks)
    try:
        optimizer.param_groups[0]["params"][0].grad = torch.ones(3)
        with step_hooks_silenced(optimizer):
            optimizer.step()  # the hooked step: every registry it reads is empty
        assert calls == []
        assert (optimizer._optimizer_step_pre_hooks, torch_optimizer._global_optimizer_pre_hooks) == before
        assert optimizer._optimizer_step_pre_hooks is before[0]
        assert torch_optimizer._global_optimizer_pre_hooks is before[1]
        optimizer.step()
        assert calls == ["hook"] * 4
    finally:
        for handle in handles:
            handle.remove()


def test_storage_id_names_a_storage_across_resize_and_views() -> None:
    tensor = torch.zeros(16)
    key = storage_id(tensor.untyped_storage())
    assert storage_id(tensor[4:].untyped_storage()) == key  # a view shares the storage
    tensor.untyped_storage().resize_(0)
    assert storage_id(tensor.untyped_storage()) == key  # released, the same storage
    other = torch.zeros(16)
    assert storage_id(other.untyped_storage()) != key


def test_profiler_enabled_follows_torchs_profiler() -> None:
    assert profiler_enabled() is False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert profiler_enabled() is True
    assert profiler_enabled() is False


def test_op_schema_reads_writes_views_and_host_results() -> None:
    add_ = op_schema(torch.ops.aten.add_.Tensor)
    assert (add_.name, add_.packet, add_.is_view) == ("aten::add_.Tensor", "add_", False)
    assert add_.written_arguments == ((0, "self"),) and not add_.returns_non_tensor
    foreach = op_schema(torch.ops.aten._foreach_add_.Scalar)
    assert foreach.written_arguments == ((0, "self"),)  # a Tensor(a!)[] list
    assert op_schema(torch.ops.aten.view.default).is_view
    assert op_schema(torch.ops.aten.item.default).returns_non_tensor
    assert issubclass(TorchDispatchMode, object) and hasattr(TorchDispatchMode, "__torch_dispatch__")


def test_private_function_finds_torchs_function_or_names_what_moved() -> None:
    found = private_function("torch.optim.optimizer", "_get_scalar_dtype", user="a test")
    assert found is torch_optimizer._get_scalar_dtype
    moved = r"no torch\.optim\.optimizer\._gone \(checked: torch 2\.13\), which a test"
    with pytest.raises(TorchCompatError, match=moved):
        private_function("torch.optim.optimizer", "_gone", user="a test")
    with pytest.raises(TorchCompatError, match=r"no torch\._no_such_module\.f"):
        private_function("torch._no_such_module", "f", user="a test")


def test_tensor_version_counts_in_place_writes() -> None:
    tensor = torch.zeros(2)
    before = tensor_version(tensor)
    tensor.add_(1)
    assert tensor_version(tensor) == before + 1


def test_hook_registries_are_the_instances_live_dicts() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    handle = optimizer.register_step_pre_hook(lambda *_: None)
    registries = hook_registries(optimizer)
    assert set(registries) == set(HOOK_REGISTRIES), "torch 2.13 makes every registry in Optimizer.__init__"
    assert handle.id in registries["_optimizer_step_pre_hooks"]
    handle.remove()
    assert not registries["_optimizer_step_pre_hooks"], "the live dict, not a copy"


def test_amp_scaling_support_is_what_grad_scaler_reads() -> None:
    fused = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1, fused=True)
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    for wrapped, expected in ((fused, True), (plain, False)):
        wrapper = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        share_amp_scaling_support(wrapper, wrapped)
        assert getattr(wrapper, "_step_supports_amp_scaling", None) is expected


def test_an_lr_schedulers_step_wrapper_is_recognised() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    assert not is_lr_scheduler_step_wrapper(vars(optimizer).get("step"))
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    assert is_lr_scheduler_step_wrapper(vars(optimizer).get("step")), "torch's scheduler no longer marks its wrapper"
    assert not is_lr_scheduler_step_wrapper(torch.optim.SGD.step)


class _Recorder:
    """What the hooks of a backward saw: the task id, whether it ran in a reentrant backward, callbacks run."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, bool]] = []
        self.callbacks: list[str] = []

    @property
    def tasks(self) -> list[int]:
        return [task for _, task, _ in self.seen]

    def hook(self, name: str) -> Any:
        def seen(grad: torch.Tensor) -> None:
            self.seen.append((name, current_backward_task(), inside_reentrant_backward()))
            queue_backward_callback(lambda: self.callbacks.append(name))

        return seen


def test_backward_tasks_are_told_apart_and_a_callback_runs_when_its_backward_ends() -> None:
    assert current_backward_task() == -1, "outside any backward"
    weight = torch.nn.Parameter(torch.ones(3))
    recorder = _Recorder()
    weight.register_hook(recorder.hook("first"))
    (weight * 2).sum().backward()
    assert recorder.callbacks == ["first"], "the queued callback ran as that backward ended"
    weight.register_hook(recorder.hook("second"))
    (weight * 3).sum().backward()
    first, second, third = recorder.tasks
    assert first >= 0 and second == third > first, "one id per backward, growing with every backward begun"
    assert not any(reentrant for _, _, reentrant in recorder.seen)


class _Reentrant(torch.autograd.Function):
    """Runs a backward of its own inside its backward, as ``checkpoint(use_reentrant=True)`` does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            (x.detach() * weight).backward(grad)
        return None, None


def test_a_backward_run_from_a_functions_backward_is_reentrant_with_a_newer_task() -> None:
    inner = torch.nn.Parameter(torch.ones(2))
    outer = torch.nn.Parameter(torch.ones(2))
    recorder = _Recorder()
    inner.register_hook(recorder.hook("inner"))
    outer.register_hook(recorder.hook("outer"))
    (_Reentrant.apply(torch.ones(2), inner) * outer).sum().backward()
    # The outer backward also calls inner's hook (the Function returns no gradient for it), in the outer task.
    outer_task = recorder.seen[0][1]
    assert recorder.seen[0] == ("outer", outer_task, False)
    assert recorder.seen[1][0] == "inner" and recorder.seen[1][2], "in the backward its Function started"
    assert recorder.seen[1][1] > outer_task, "a nested backward's id is above its outer one's"
    assert recorder.seen[2] == ("inner", outer_task, False)
    assert recorder.callbacks == ["inner", "outer", "inner"], "the nested callback runs as the nested backward ends"
    assert inner.grad is not None and torch.equal(inner.grad, torch.ones(2))


def test_a_backward_that_raises_runs_no_queued_callback() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    recorder = _Recorder()
    weight.register_hook(recorder.hook("raising"))

    def fail(grad: torch.Tensor) -> None:
        raise RuntimeError("a failing hook")

    weight.register_hook(fail)
    with pytest.raises(RuntimeError, match="a failing hook"):
        (weight * 2).sum().backward()
    assert recorder.callbacks == [], "the callback is for a backward that ends without an error"


def test_unscale_gradients_is_grad_scalers_kernel() -> None:
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([8.0])]
    found_inf = torch.zeros(1)
    unscale_gradients_(grads, found_inf, torch.tensor([0.5]))
    assert [g.tolist() for g in grads] == [[1.0, 2.0], [4.0]] and found_inf.item() == 0.0
    with_inf = [torch.tensor([1.0, float("inf")])]
    unscale_gradients_(with_inf, found_inf, torch.tensor([0.5]))
    assert found_inf.item() == 1.0, "an inf among the gradients sets found_inf"
