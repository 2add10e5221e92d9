"""SwapOptimizer behaviour users rely on beyond the conformance rows: the torch.optim contract."""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.adapters.registry import AdapterRegistry
from swap_core.adapters.rmsprop import RMSpropAdapter
from swap_core.errors import AdapterNotFoundError, StateDictMismatchError, UnsupportedOptimizerError
from swap_core.sim import MemoryKind, SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_core.testing.conformance import through_torch_save
from swap_core.testing.views import planned_batches

SHAPES = [(32, 40), (40,), (24, 24), (8,), (30, 30)]


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def wrapped(params: list[torch.nn.Parameter], backend: SimBackend | None = None, **options: Any) -> SwapOptimizer:
    config = SwapConfig(backend=backend or SimBackend(), swap_times=2, min_numel=64, **options)
    return swap_optimizer(torch.optim.RMSprop(params, lr=1e-2, momentum=0.5), config)


def assert_params_equal(first: list[torch.nn.Parameter], second: list[torch.nn.Parameter]) -> None:
    for index, (a, b) in enumerate(zip(first, second, strict=True)):
        assert_bitwise_equal(a, b, f"parameter {index}")


def test_cpu_params_with_auto_backend_run_the_plain_optimizer() -> None:
    plain_params, swapped_params = make_params(), make_params()
    plain = torch.optim.RMSprop(plain_params, lr=1e-2)
    opt = swap_optimizer(torch.optim.RMSprop(swapped_params, lr=1e-2))
    assert opt.backend is None
    for step in range(3):
        set_grads(plain_params, step)
        set_grads(swapped_params, step)
        plain.step()
        opt.step()
    assert_params_equal(plain_params, swapped_params)
    assert opt.stats.batches == 0


def test_wrapping_twice_is_refused() -> None:
    opt = wrapped(make_params())
    with pytest.raises(ValueError, match="already a SwapOptimizer"):
        swap_optimizer(opt)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already a SwapOptimizer"):
        SwapOptimizer(opt, SwapConfig(), RMSpropAdapter)


def test_unknown_state_keys_name_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"Unknown state_keys \['exp_avg'\] for RMSprop; swappable keys are"):
        wrapped(make_params(), state_keys=("exp_avg",))


def test_sparse_gradients_are_refused_at_step() -> None:
    params = make_params()
    opt = wrapped(params)
    set_grads(params, 0)
    params[1].grad = params[1].grad.to_sparse()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"Parameter \(40,\) of param group 0 has a sparse gradient"):
        opt.step()


def test_params_on_several_devices_are_refused() -> None:
    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, device="meta"))]
    with pytest.raises(ValueError, match=r"Parameters live on several devices \['cpu', 'meta'\]"):
        swap_optimizer(torch.optim.RMSprop(params), backend="sim")


def test_sim_backend_refuses_accelerator_names_on_cpu() -> None:
    with pytest.raises(ValueError, match="backend='cuda' but the parameters are on cpu"):
        swap_optimizer(torch.optim.RMSprop(make_params()), backend="cuda")


def test_optimizer_without_adapter_says_how_to_add_one() -> None:
    # Which family packages are installed varies (swap-generic serves Adagrad): resolve without any plugin.
    registry = AdapterRegistry(entry_points=list)
    registry.register(torch.optim.RMSprop, RMSpropAdapter, name="rmsprop")
    pattern = r"No swap adapter is registered for torch\.optim\.adagrad\.Adagrad.*--find-links dist swap-core swap-gen"
    with pytest.raises(AdapterNotFoundError, match=pattern):
        registry.resolve(torch.optim.Adagrad(make_params()))


def test_overrides_are_validated() -> None:
    with pytest.raises(ValueError, match="swap_times: 0"):
        swap_optimizer(torch.optim.RMSprop(make_params()), swap_times=0)
    with pytest.raises(TypeError, match="Unknown SwapConfig field"):
        swap_optimizer(torch.optim.RMSprop(make_params()), swaptimes=3)


def test_closure_hooks_and_profiler_ranges() -> None:
    params = make_params()
    opt = wrapped(params)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))  # type: ignore[arg-type,func-returns-value]
    opt.register_step_post_hook(lambda *_: calls.append("post"))  # type: ignore[arg-type,func-returns-value]
    opt.register_state_dict_pre_hook(lambda *_: calls.append("sd_pre"))  # type: ignore[arg-type,func-returns-value]
    opt.register_load_state_dict_post_hook(lambda *_: calls.append("load_post"))  # type: ignore[arg-type,func-returns-value]

    def closure() -> float:
        set_grads(params, 0)
        return 1.5

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        assert opt.step(closure) == 1.5
    names = {event.name for event in profile.events()}
    assert {"swap::prefetch", "swap::update", "swap::offload"} <= names
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "sd_pre", "load_post"]


@pytest.mark.parametrize("swapped", [True, False], ids=["swapped", "cpu_params_unswapped"])
def test_step_hooks_run_once_per_step_as_torchs(swapped: bool) -> None:
    # Instance hooks on either handle, before or after wrapping, and global hooks: once each, as torch runs them.
    params = make_params()
    plain = torch.optim.RMSprop(params, lr=1e-2)
    calls: list[str] = []
    plain.register_step_pre_hook(lambda *_: calls.append("pre, on the plain optimizer"))  # type: ignore[arg-type,func-returns-value]
    opt = wrapped_plain(plain, backend=SimBackend() if swapped else None)
    assert (opt.backend is not None) is swapped
    opt.register_step_post_hook(lambda *_: calls.append("post, on the wrapper"))  # type: ignore[arg-type,func-returns-value]
    handle = register_optimizer_step_pre_hook(lambda *_: calls.append("global pre"))
    try:
        set_grads(params, 0)
        opt.step()
    finally:
        handle.remove()
    assert calls == ["global pre", "pre, on the plain optimizer", "post, on the wrapper"], calls


def wrapped_plain(optimizer: torch.optim.Optimizer, backend: SimBackend | None) -> SwapOptimizer:
    if backend is None:
        return swap_optimizer(optimizer)  # CPU parameters, backend "auto": the wrapped optimizer's own step
    return swap_optimizer(optimizer, SwapConfig(backend=backend, swap_times=2, min_numel=64))


SCHEDULERS: list[Callable[[torch.optim.Optimizer], Any]] = [
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=8),
    lambda opt: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=3),
    lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [torch.optim.lr_scheduler.LinearLR(opt, 0.1), torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)],
        milestones=[3],
    ),
    lambda opt: torch.optim.lr_scheduler.ChainedScheduler(
        [torch.optim.lr_scheduler.ConstantLR(opt, 0.5, total_iters=2), torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)]
    ),
    lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0),
]


@pytest.mark.parametrize("make_scheduler", SCHEDULERS, ids=lambda f: str(SCHEDULERS.index(f)))
def test_lr_schedulers_follow_the_same_trajectory(make_scheduler: Callable[[torch.optim.Optimizer], Any]) -> None:
    plain_params, swapped_params = make_params(), make_params()
    plain = torch.optim.RMSprop(plain_params, lr=1e-2, momentum=0.5)
    opt = wrapped(swapped_params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain_scheduler, swapped_scheduler = make_scheduler(plain), make_scheduler(opt)
        for step in range(8):
            set_grads(plain_params, step)
            set_grads(swapped_params, step)
            plain.step()
            opt.step()
            if isinstance(plain_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                plain_scheduler.step(1.0)
                swapped_scheduler.step(1.0)
            else:
                plain_scheduler.step()
                swapped_scheduler.step()
            assert [g["lr"] for g in plain.param_groups] == [g["lr"] for g in opt.param_groups]
    assert_params_equal(plain_params, swapped_params)


def test_add_param_group_mid_training() -> None:
    plain_params, swapped_params = make_params(), make_params()
    plain = torch.optim.RMSprop(plain_params[:3], lr=1e-2, momentum=0.5)
    opt = wrapped(swapped_params[:3])
    for step in range(6):
        if step == 2:
            plain.add_param_group({"params": plain_params[3:], "lr": 5e-3})
            opt.add_param_group({"params": swapped_params[3:], "lr": 5e-3})
        set_grads(plain_params, step)
        set_grads(swapped_params, step)
        plain.step()
        opt.step()
    assert_params_equal(plain_params, swapped_params)
    assert_state_dicts_equal(plain.state_dict(), opt.state_dict(), "after add_param_group")


def test_existing_states_are_offloaded_at_wrap_time() -> None:
    plain_params, swapped_params = make_params(), make_params()
    plain = torch.optim.RMSprop(plain_params, lr=1e-2, momentum=0.5)
    inner = torch.optim.RMSprop(swapped_params, lr=1e-2, momentum=0.5)
    for step in range(2):
        for params, optimizer in ((plain_params, plain), (swapped_params, inner)):
            set_grads(params, step)
            optimizer.step()
    backend = SimBackend()
    opt = swap_optimizer(inner, SwapConfig(backend=backend, swap_times=2, min_numel=64))
    assert backend.memory_allocated() == 0
    square_avg = opt.state[swapped_params[0]]["square_avg"]
    assert backend.memory_kind(square_avg) is MemoryKind.HOST
    for step in range(2, 5):
        set_grads(plain_params, step)
        set_grads(swapped_params, step)
        plain.step()
        opt.step()
    assert_params_equal(plain_params, swapped_params)


def test_small_states_stay_resident_and_are_still_updated() -> None:
    backend = SimBackend()
    params = make_params()
    opt = wrapped(params, backend=backend)
    set_grads(params, 0)
    opt.step()
    assert backend.memory_kind(opt.state[params[3]]["square_avg"]) is MemoryKind.DEVICE
    assert backend.memory_kind(opt.state[params[0]]["square_avg"]) is MemoryKind.HOST
    assert opt.stats.resident_state_device_bytes == 2 * (40 + 8) * 4  # square_avg + momentum of the 2 small params


def test_state_dict_and_load_never_touch_device_memory() -> None:
    backend = SimBackend()
    params = make_params()
    opt = wrapped(params, backend=backend)
    for step in range(2):
        set_grads(params, step)
        opt.step()
    before = backend.memory_allocated()
    backend.reset_peak_memory_stats()
    opt.load_state_dict(through_torch_save(opt.state_dict()))
    # Swapped state never visits the device; only the resident states are rebuilt (old and new briefly coexist).
    resident = opt.stats.resident_state_device_bytes
    assert resident == before == backend.memory_allocated() == 384
    assert backend.max_memory_allocated() == before + resident


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])), "has 2 parameter groups"),
        (lambda sd: sd["param_groups"][0]["params"].pop(), "has 4 parameters, the optimizer's has 5"),
        (lambda sd: sd["state"][0].__setitem__("square_avg", torch.zeros(3, 3)), "'square_avg' of shape \\(3, 3\\)"),
        (lambda sd: sd.pop("state"), "Not an optimizer state dict"),
        (lambda sd: sd["state"].__setitem__(99, {}), "parameter id 99"),
    ],
)
def test_mismatched_state_dict_raises_and_keeps_state(mutate: Callable[[dict[str, Any]], Any], message: str) -> None:
    params = make_params()
    opt = wrapped(params)
    set_grads(params, 0)
    opt.step()
    before = through_torch_save(opt.state_dict())
    bad = through_torch_save(opt.state_dict())
    mutate(bad)
    with pytest.raises(StateDictMismatchError, match=message):
        opt.load_state_dict(bad)
    assert_state_dicts_equal(before, opt.state_dict(), "after a refused load")
    set_grads(params, 1)
    opt.step()  # still works


def test_reset_optimizer_parameters_moves_state_to_new_params() -> None:
    plain_params, swapped_params = make_params(), make_params()
    plain = torch.optim.RMSprop(plain_params, lr=1e-2, momentum=0.5)
    opt = wrapped(swapped_params)
    for step in range(2):
        set_grads(plain_params, step)
        set_grads(swapped_params, step)
        plain.step()
        opt.step()
    replacements = [torch.nn.Parameter(param.detach().clone()) for param in swapped_params]
    opt.reset_optimizer_parameters(dict(zip(replacements, swapped_params, strict=True)))
    assert opt.param_groups[0]["params"][0] is replacements[0]
    for step in range(2, 5):
        set_grads(plain_params, step)
        set_grads(replacements, step)
        plain.step()
        opt.step()
    assert_params_equal(plain_params, replacements)
    assert_state_dicts_equal(plain.state_dict(), opt.state_dict(), "after reset_optimizer_parameters")


def test_reset_optimizer_parameters_rejects_bad_mapping() -> None:
    params = make_params()
    opt = wrapped(params)
    with pytest.raises(ValueError, match="not in this optimizer's param groups"):
        opt.reset_optimizer_parameters({torch.nn.Parameter(torch.zeros(2)): torch.nn.Parameter(torch.zeros(2))})
    with pytest.raises(ValueError, match="does not match"):
        opt.reset_optimizer_parameters({torch.nn.Parameter(torch.zeros(2)): params[0]})


def test_state_dict_exports_the_host_mirrors_without_copying() -> None:
    backend = SimBackend()
    params = make_params()
    opt = wrapped(params, backend=backend)
    set_grads(params, 0)
    opt.step()
    exported = opt.state_dict()["state"][0]["square_avg"]
    assert backend.memory_kind(exported) is MemoryKind.HOST
    assert exported.data_ptr() == opt.state[params[0]]["square_avg"].data_ptr()


def test_existing_view_and_transposed_states_are_swapped_in_their_layout_and_sparse_views_stay_resident() -> None:
    plain_params, swapped_params = make_params(), make_params()
    plain = torch.optim.RMSprop(plain_params, lr=1e-2, momentum=0.5)
    inner = torch.optim.RMSprop(swapped_params, lr=1e-2, momentum=0.5)
    for params, optimizer in ((plain_params, plain), (swapped_params, inner)):
        set_grads(params, 0)
        optimizer.step()
    # A view into a larger buffer (as torch.load gives for a whole checkpoint) is copied to host memory.
    shared = torch.zeros(2, *swapped_params[0].shape)
    shared[1].copy_(inner.state[swapped_params[0]]["square_avg"])
    inner.state[swapped_params[0]]["square_avg"] = shared[1]
    # A dense non-contiguous (transposed) state is swapped in its own memory order.
    transposed = inner.state[swapped_params[2]]["square_avg"].t().contiguous().t()
    inner.state[swapped_params[2]]["square_avg"] = transposed
    # A view that skips elements cannot be moved as one block: it stays resident, as it is.
    every_other = torch.zeros(*swapped_params[4].shape[:-1], 2 * swapped_params[4].shape[-1])[..., ::2]
    every_other.copy_(inner.state[swapped_params[4]]["square_avg"])
    inner.state[swapped_params[4]]["square_avg"] = every_other
    backend = SimBackend()
    opt = swap_optimizer(inner, SwapConfig(backend=backend, swap_times=2, min_numel=64))
    assert backend.memory_kind(opt.state[swapped_params[0]]["square_avg"]) is MemoryKind.HOST
    swapped_transposed = opt.state[swapped_params[2]]["square_avg"]
    assert backend.memory_kind(swapped_transposed) is MemoryKind.HOST
    assert swapped_transposed.stride() == transposed.stride() != swapped_params[2].stride()
    assert opt.state[swapped_params[4]]["square_avg"] is every_other
    for step in range(1, 4):
        set_grads(plain_params, step)
        set_grads(swapped_params, step)
        plain.step()
        opt.step()
    assert_params_equal(plain_params, swapped_params)
    assert_state_dicts_equal(plain.state_dict(), opt.state_dict(), "after wrapping view and strided states")


class _CostAdapter(RMSpropAdapter):
    """Gives the last parameter all the cost: it must end up alone in the last batch."""

    def partition_costs(self, params: Any) -> list[int]:
        return [1] * (len(params) - 1) + [1000]


def test_adapter_partition_costs_drive_the_batches() -> None:
    params = make_params()
    opt = SwapOptimizer(
        torch.optim.RMSprop(params, lr=1e-2), SwapConfig(backend=SimBackend(), swap_times=2, min_numel=64), _CostAdapter
    )
    set_grads(params, 0)
    opt.step()
    batches = planned_batches(opt)
    assert [len(batch.params) for batch in batches] == [4, 1]
    assert batches[1].params[0] is params[-1]


class _RefusingAdapter(RMSpropAdapter):
    """Refuses the third parameter when asked for its initial state."""

    def initial_state(self, param: torch.Tensor, group: dict[str, Any]) -> Any:
        if param.shape == SHAPES[2]:
            raise ValueError("refused")
        return super().initial_state(param, group)


def test_adapter_refusing_a_fresh_state_leaves_no_partial_state() -> None:
    params = make_params()
    opt = SwapOptimizer(
        torch.optim.RMSprop(params, lr=1e-2), SwapConfig(backend=SimBackend(), min_numel=64), _RefusingAdapter
    )
    set_grads(params, 0)
    with pytest.raises(ValueError, match="refused"):
        opt.step()
    assert all(not opt.state[param] for param in params)
    params[2].grad = None  # without the refused parameter the step works
    opt.step()
    assert set(opt.state[params[0]]) == {"step", "square_avg"}


class _FailingUpdateAdapter(RMSpropAdapter):
    def update(self, batch: Any) -> None:
        staged = [state["square_avg"] for state in batch.states]  # device views, released after the failure
        assert staged
        raise RuntimeError("update failed")


def test_failed_update_leaves_no_released_storage_in_traceback_locals() -> None:
    params = make_params()
    opt = SwapOptimizer(
        torch.optim.RMSprop(params, lr=1e-2), SwapConfig(backend=SimBackend(), min_numel=64), _FailingUpdateAdapter
    )
    set_grads(params, 0)
    with pytest.raises(RuntimeError, match="update failed") as caught:
        opt.step()
    # Showing these locals (pytest --showlocals, a debugger) must not read freed memory.
    for frame, _ in traceback.walk_tb(caught.value.__traceback__):
        for value in frame.f_locals.values():
            values = value if isinstance(value, list) else [value]
            for item in values:
                if isinstance(item, torch.Tensor) and item.numel():
                    assert item.untyped_storage().nbytes() > 0, f"{frame.f_code.co_name} holds a released tensor"


def test_checkpoint_loaded_into_plain_then_wrapped_is_swapped_again() -> None:
    params = make_params()
    opt = wrapped(params)
    set_grads(params, 0)
    opt.step()
    # torch.load returns views into one storage per dtype: they must swap like any state.
    plain = torch.optim.RMSprop(params, lr=1e-2, momentum=0.5)
    plain.load_state_dict(through_torch_save(opt.state_dict()))
    rewrapped = swap_optimizer(plain, SwapConfig(backend=SimBackend(), swap_times=2, min_numel=64))
    set_grads(params, 1)
    rewrapped.step()
    assert rewrapped.stats.host_state_bytes == opt.stats.host_state_bytes > 0


def test_initialize_state_creates_first_step_states_without_touching_the_device() -> None:
    backend = SimBackend()
    params = make_params()
    frozen = torch.nn.Parameter(torch.randn(16, 16), requires_grad=False)
    opt = swap_optimizer(
        torch.optim.RMSprop([*params, frozen], lr=1e-2, momentum=0.5),
        SwapConfig(backend=backend, swap_times=2, min_numel=64),
    )
    backend.reset_copy_stats()
    backend.reset_peak_memory_stats()
    opt.initialize_state()
    stats = backend.copy_stats
    assert (stats.h2d_copies, stats.d2h_copies, stats.d2d_copies) == (0, 0, 0)
    # Only the two small resident states (40 and 8 elements, two keys each) take device memory.
    assert backend.max_memory_allocated() == (40 + 8) * 4 * 2
    assert frozen not in opt.state
    for param in params:
        state = opt.state[param]
        assert set(state) == {"step", "square_avg", "momentum_buffer"}
        assert state["step"].item() == 0
        assert not state["square_avg"].any() and not state["momentum_buffer"].any()
    opt.initialize_state()  # existing states are kept
    assert backend.copy_stats.h2d_copies == 0

    reference = make_params()
    plain = torch.optim.RMSprop([*reference, frozen], lr=1e-2, momentum=0.5)
    for step in range(3):
        set_grads(params, step)
        set_grads(reference, step)
        opt.step()
        plain.step()
    assert_params_equal(reference, params)
    assert_state_dicts_equal(plain.state_dict(), opt.state_dict(), "after initialize_state and 3 steps")


def test_initialize_state_needs_a_backend() -> None:
    opt = swap_optimizer(torch.optim.RMSprop(make_params(), lr=1e-2), SwapConfig(backend="auto"))
    with pytest.raises(RuntimeError, match="needs a swap backend"):
        opt.initialize_state()


class _TaggingAdapter(RMSpropAdapter):
    """Checkpoint form: every state also carries a ``"tag"``; importing strips it again."""

    def export_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        state = {saved_id: {**entry, "tag": 1} for saved_id, entry in state_dict["state"].items()}
        return {**state_dict, "state": state}

    def import_state_dict(self, state_dict: Any) -> Any:
        for saved_id, entry in state_dict["state"].items():
            if entry.get("tag") != 1:
                raise ValueError(f"state of {saved_id!r} lacks its tag")
        state = {
            saved_id: {k: v for k, v in entry.items() if k != "tag"} for saved_id, entry in state_dict["state"].items()
        }
        return {**state_dict, "state": state}


def test_adapter_checkpoint_form_is_what_state_dict_and_load_state_dict_exchange() -> None:
    params = make_params()
    opt = SwapOptimizer(
        torch.optim.RMSprop(params, lr=1e-2), SwapConfig(backend=SimBackend(), min_numel=64), _TaggingAdapter
    )
    set_grads(params, 0)
    opt.step()
    seen: list[bool] = []
    opt.register_state_dict_post_hook(lambda _, sd: seen.append(all("tag" in e for e in sd["state"].values())))  # type: ignore[arg-type,func-returns-value]
    opt.register_load_state_dict_pre_hook(lambda _, sd: seen.append(all("tag" in e for e in sd["state"].values())))  # type: ignore[arg-type,func-returns-value]
    saved = opt.state_dict()
    assert all(entry["tag"] == 1 for entry in saved["state"].values())
    assert all("tag" not in opt.state[param] for param in params)  # the live state is never changed
    opt.load_state_dict(through_torch_save(saved))
    assert seen == [True, True]  # user hooks see the checkpoint form
    assert all(set(opt.state[param]) == {"step", "square_avg"} for param in params)
    # The wrapped optimizer's own state_dict() is the same checkpoint (the two share their hooks).
    assert all(entry["tag"] == 1 for entry in opt.optimizer.state_dict()["state"].values())
    untagged = {**saved, "state": {i: {k: v for k, v in e.items() if k != "tag"} for i, e in saved["state"].items()}}
    with pytest.raises(ValueError, match="lacks its tag"):
        opt.load_state_dict(untagged)
    set_grads(params, 1)
    opt.step()


def test_nothing_swapped_keeps_the_checkpoint_form_of_the_wrapped_optimizer() -> None:
    """With nothing swapped (CPU parameters, backend="auto") the wrapped optimizer's own step keeps its state in its
    own layout: the adapter's checkpoint glue, which is for a live layout of its own, is not applied either way."""
    params, plain_params = make_params(), make_params()
    opt = SwapOptimizer(torch.optim.RMSprop(params, lr=1e-2), SwapConfig(backend="auto"), _TaggingAdapter)
    plain = torch.optim.RMSprop(plain_params, lr=1e-2)
    assert opt.backend is None
    for step in range(2):
        for some_params, optimizer in ((params, opt), (plain_params, plain)):
            set_grads(some_params, step)
            optimizer.step()
    saved = opt.state_dict()
    assert_state_dicts_equal(plain.state_dict(), saved, "the unswapped optimizer's state dict")
    opt.load_state_dict(through_torch_save(plain.state_dict()))  # a plain checkpoint: no tag to strip
    assert all(set(opt.state[param]) == {"step", "square_avg"} for param in params)


def test_step_keeps_no_reference_to_the_gradients() -> None:
    """zero_grad(set_to_none=True) frees gradient memory: the swapped step must not hold on to gradients."""
    import weakref

    params = make_params()
    opt = wrapped(params)
    for step in range(2):
        set_grads(params, step)
        opt.step()
    grads = [weakref.ref(param.grad) for param in params if param.grad is not None]
    assert len(grads) == len(params)
    opt.zero_grad(set_to_none=True)
    assert all(grad() is None for grad in grads)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (
            iter([torch.nn.Parameter(torch.zeros(2))]),
            r"got a list_iterator \(parameters\?\): build the optimizer first",
        ),
        (torch.nn.Linear(2, 2).parameters(), r"got a generator \(parameters\?\)"),
        (
            torch.optim.AdamW,
            r"got the class AdamW: build it first, swap_optimizer\(AdamW\(model\.parameters\(\), \.\.\.\)\)",
        ),
        (object(), r"expects a torch\.optim\.Optimizer instance, got a object$"),
    ],
    ids=["iterator", "parameters", "class", "object"],
)
def test_swap_optimizer_of_something_else_than_an_optimizer_says_what_it_expects(value: Any, words: str) -> None:
    with pytest.raises(TypeError, match=words):
        swap_optimizer(value, backend="sim")


def test_the_wrapped_optimizers_own_state_dict_is_the_synchronized_checkpoint() -> None:
    """Hooks are shared: the plain handle's state_dict() waits for the offloads and exports like the wrapper's."""
    params, reference_params = make_params(), make_params()
    reference = torch.optim.RMSprop(reference_params, lr=1e-2, momentum=0.5)
    opt = wrapped(params, SimBackend(mode="lazy"))
    for step in range(2):
        set_grads(params, step)
        set_grads(reference_params, step)
        opt.step()
        reference.step()
    assert_state_dicts_equal(reference.state_dict(), opt.optimizer.state_dict(), "the wrapped optimizer's state_dict")


def test_a_read_only_state_property_is_refused_clearly_before_anything_changes() -> None:
    class ReadOnlyState(torch.optim.SGD):
        """Keeps its state behind a property that refuses assignment once the optimizer is built."""

        @property  # type: ignore[override]
        def state(self) -> Any:
            return self.__dict__["_state"]

        @state.setter
        def state(self, value: Any) -> None:
            if "_state" in self.__dict__:
                raise AttributeError("state is read-only")
            self.__dict__["_state"] = value

    params = [torch.nn.Parameter(torch.randn(64, 64))]
    plain = ReadOnlyState(params, lr=0.1, momentum=0.9)
    with pytest.raises(
        UnsupportedOptimizerError, match=r"ReadOnlyState.state cannot be assigned \(state is read-only\)"
    ):
        swap_optimizer(plain, SwapConfig(backend=SimBackend()))
    assert isinstance(plain.state, dict) and not plain.state


def test_cpu_parameters_with_the_auto_backend_say_that_nothing_is_swapped() -> None:
    params = [torch.nn.Parameter(torch.randn(64, 64))]
    with pytest.warns(UserWarning, match=r"on the CPU, so nothing is swapped.*SwapConfig\(backend='sim'\)"):
        swapped = swap_optimizer(torch.optim.SGD(params, lr=0.1))
    assert swapped.backend is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        swap_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.randn(64, 64))], lr=0.1), backend="sim")
        swap_optimizer(torch.optim.SGD([{"params": []}], lr=0.1))  # no parameter yet: nothing to say


def test_fewer_swapped_parameters_than_swap_times_warn_once_why_the_batches_are_fewer() -> None:
    """A batch holds whole parameters: 2 swapped weights cannot split into 4 batches. The step runs 2 and says so,
    once; the small biases' states (under min_numel) stay on the device and do not count."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    optimizer = swap_optimizer(torch.optim.RMSprop(model.parameters()), SwapConfig(backend=SimBackend(), swap_times=4))
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    with pytest.warns(UserWarning, match=r"swap_times=4\) asked for 4 batches, but only 2 parameters") as record:
        optimizer.step()
    assert "min_numel=1024" in str(record[0].message) and optimizer.stats.batches == 2
    assert record[0].filename == __file__, "the warning points at the user's line"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()  # once: the same plan warns no more
    split = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    optimizer = swap_optimizer(torch.optim.RMSprop(split.parameters()), SwapConfig(backend=SimBackend(), swap_times=4))
    for param in split.parameters():
        param.grad = torch.ones_like(param)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
    assert optimizer.stats.batches == 4
