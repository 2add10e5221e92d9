"""SwapConfig(master_weights=True) through the generic adapter: the optimizer's own step runs on the fp32 masters.

Every optimizer swap-generic runs gains master weights through swap-core's one mechanism: the
masters are presented to the optimizer's step as its parameters (fp32 gradients as ``.grad``, the
states without the master as their ``optimizer.state`` entries), and the states that step creates are
born fp32 on the device, one batch at a time, then swapped. Each row is held bitwise, parameters,
masters and every state after every step, to the reference (swap_core.testing.masters): the plain
optimizer over fp32 leaf copies of the bf16/fp16 parameters.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer
from swap_core.errors import StateDictMismatchError, SwapStateError
from swap_core.master_weights import MASTER_KEY, MASTER_KEYS, REMAINDER_KEY, master_of
from swap_core.master_weights.remainder import remainder_nbytes
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal
from swap_core.testing.conformance import MASTER_MODES, ConformanceCase, through_torch_save
from swap_core.testing.masters import (
    MasterReference,
    check_master_weights,
    mixed_precision_params,
    set_same_grads,
    sharded_on,
)
from swap_generic import GenericAdapter

pytestmark = pytest.mark.sim_only  # the simulator's checks (races, owns) are the point

Factory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

MIN_NUMEL = 64
STEPS = 8


def _lion(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    lion_pytorch = pytest.importorskip("lion_pytorch")
    optimizer: torch.optim.Optimizer = lion_pytorch.Lion(params, lr=1e-3, weight_decay=0.1)
    return optimizer


FACTORIES: dict[str, Factory] = {
    "sgd_plain": lambda params: torch.optim.SGD(params, lr=0.05),  # keeps no state: the master alone is swapped
    "sgd_nesterov_wd": lambda params: torch.optim.SGD(
        params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=True
    ),
    "sgd_fused": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True),
    # Adagrad's constructor makes its states (in the parameters' dtype): they become fp32 at wrapping, exactly
    # for the default initial_accumulator_value of 0.
    "adagrad_lr_decay": lambda params: torch.optim.Adagrad(params, lr=0.05, lr_decay=0.01, weight_decay=0.1),
    "adagrad_fused": lambda params: torch.optim.Adagrad(params, lr=0.05, fused=True),
    "adadelta_maximize": lambda params: torch.optim.Adadelta(params, lr=0.5, maximize=True),
    "adamax_foreach": lambda params: torch.optim.Adamax(params, lr=0.01, foreach=True),
    "asgd": lambda params: torch.optim.ASGD(params, lr=0.01, t0=3),
    "nadam_decoupled": lambda params: torch.optim.NAdam(
        params, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True, momentum_decay=0.01
    ),
    "radam_decoupled": lambda params: torch.optim.RAdam(params, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True),
    "rprop": lambda params: torch.optim.Rprop(params, lr=0.01),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=0.01),  # factored states, shaped unlike the param
    # Through the generic path, as a cross-check of the dedicated adapters' master weights.
    "adam_amsgrad_generic": lambda params: torch.optim.Adam(params, lr=0.01, amsgrad=True),
    "adamw_fused_generic": lambda params: torch.optim.AdamW(params, lr=0.01, fused=True),
    "rmsprop_centered_generic": lambda params: torch.optim.RMSprop(params, lr=0.01, centered=True, momentum=0.9),
    "lion": _lion,
}


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    """bf16, fp16 and fp32 parameters, one under MIN_NUMEL (its master and states stay resident)."""
    return mixed_precision_params(seed)


def swapped(params: list[torch.nn.Parameter], factory: Factory, backend: SimBackend, **options: Any) -> SwapOptimizer:
    config = SwapConfig(backend=backend, swap_times=2, min_numel=MIN_NUMEL, master_weights=True, **options)
    with warnings.catch_warnings():  # Adagrad's constructor states get their masters at wrapping (one warning)
        warnings.filterwarnings("ignore", message=r".*had optimizer states before wrapping")
        return SwapOptimizer(factory(list(params)), config, adapter_factory=GenericAdapter)


def train(reference: MasterReference, optimizer: SwapOptimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        reference.set_grads(step, params)
        reference.step()
        optimizer.step()


# Rows of the conformance suite's master-weights axis that its generic rows do not have: the dedicated families'
# optimizers through the generic path (a cross-check of their master weights) and a third-party optimizer.
CROSS_CHECK_ROWS = ("adam_amsgrad_generic", "adamw_fused_generic", "rmsprop_centered_generic", "lion")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("mode,seed", MASTER_MODES, ids=[f"{mode}{seed}" for mode, seed in MASTER_MODES])
@pytest.mark.parametrize("name", CROSS_CHECK_ROWS)
def test_masters_step_bitwise_as_the_plain_optimizer_over_fp32_masters(
    name: str, mode: str, seed: int, packed: bool
) -> None:
    factory = FACTORIES[name]
    case = ConformanceCase(
        name,
        factory,  # type: ignore[arg-type]  # torch optimizers take a list of tensors or of groups alike
        steps=STEPS,
        adapter_factory=GenericAdapter,
        deep_copies=name != "lion",  # lion_pytorch's Lion loses decoupled_wd in a deep copy, plain or swapped
    )
    check_master_weights(case, SimBackend(mode=mode, seed=seed), packed=packed)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["sgd_plain", "nadam_decoupled", "adafactor"])
def test_between_steps_no_master_or_swapped_state_byte_is_on_the_device(name: str) -> None:
    """Every master and large state is in host memory between steps (those the step made too), fp32, and the host
    bytes are exactly theirs. (States a step makes with torch ops are device tensors the simulator does not
    allocate, so ``owns`` tells host from device here rather than ``memory_allocated``.)"""
    sim = SimBackend(mode="random", seed=5)
    params = make_params()
    optimizer = swapped(params, FACTORIES[name], sim, packed=False)
    for step in range(3):
        set_same_grads(step, params)
        optimizer.step()
        sim.synchronize()
        swapped_bytes = 0
        for index, param in enumerate(params):
            for key, value in optimizer.state[param].items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue
                # A bf16 parameter's master is its remainder (uint8, 2.125 B a parameter); every other state fp32.
                dtype = torch.uint8 if key == REMAINDER_KEY else torch.float32
                assert value.dtype == dtype, f"step {step}: {key!r} of parameter {index} is {value.dtype}"
                large = param.numel() >= MIN_NUMEL and value.numel() >= MIN_NUMEL
                assert sim.owns(value) is not large, f"step {step}: {key!r} of parameter {index}"
                swapped_bytes += value.numel() * value.element_size() if large else 0
        assert optimizer.stats.host_state_bytes == swapped_bytes, f"after step {step}"
    assert REMAINDER_KEY in optimizer.state[params[0]] and MASTER_KEYS.isdisjoint(optimizer.state[params[2]])
    if name == "sgd_plain":  # no state but the masters: 2.125 B a bf16 element, 4 B an fp16 one (swapped ones)
        low = [param for param in params if param.numel() >= MIN_NUMEL and param.dtype != torch.float32]
        masters = [remainder_nbytes(p.numel()) if p.dtype == torch.bfloat16 else 4 * p.numel() for p in low]
        assert optimizer.stats.host_state_bytes == sum(masters)


def test_adagrad_constructor_states_become_fp32_with_one_warning_naming_how_many() -> None:
    params = make_params()
    plain = torch.optim.Adagrad(list(params), lr=0.05)
    config = SwapConfig(backend=SimBackend(), swap_times=2, min_numel=MIN_NUMEL, master_weights=True)
    with pytest.warns(UserWarning, match=r"^4 bfloat16/float16 parameter\(s\) had optimizer states before wrapping"):
        optimizer = SwapOptimizer(plain, config, adapter_factory=GenericAdapter)
    for param in params:
        assert optimizer.state[param]["sum"].dtype == torch.float32
        assert (not MASTER_KEYS.isdisjoint(optimizer.state[param])) is (param.dtype != torch.float32)


def test_a_master_checkpoint_resumes_bitwise_and_a_plain_one_loads_with_masters_from_the_params() -> None:
    factory = FACTORIES["nadam_decoupled"]
    reference = MasterReference(make_params(), factory)
    params = make_params()
    optimizer = swapped(params, factory, SimBackend(mode="random", seed=3))
    train(reference, optimizer, params, range(3))
    checkpoint = through_torch_save(optimizer.state_dict())
    assert checkpoint["state"][0][MASTER_KEY].dtype == torch.float32
    assert checkpoint["state"][0]["exp_avg"].dtype == torch.float32

    resumed_params = [torch.nn.Parameter(param.detach().clone()) for param in params]
    resumed = swapped(resumed_params, factory, SimBackend(mode="random", seed=4))
    resumed.load_state_dict(checkpoint)
    reference.assert_matches(resumed, resumed_params, "resumed")
    train(reference, resumed, resumed_params, range(3, 6))
    reference.assert_matches(resumed, resumed_params, "resumed, 3 steps on")

    plain_params = make_params()
    plain = factory(list(plain_params))
    for step in range(2):
        set_same_grads(step, plain_params)
        plain.step()
    into_masters = [torch.nn.Parameter(param.detach().clone()) for param in plain_params]
    optimizer = swapped(into_masters, factory, SimBackend())
    with pytest.warns(UserWarning, match=r"no 'master_param' for 4 bfloat16/float16 parameter\(s\)"):
        optimizer.load_state_dict(through_torch_save(plain.state_dict()))
    for param, plain_param in zip(into_masters, plain_params, strict=True):
        state = optimizer.state[param]
        if param.dtype != torch.float32:
            assert_bitwise_equal(param.detach().float(), master_of(optimizer, param), "master from the parameter")
        assert_bitwise_equal(plain.state[plain_param]["exp_avg"].float(), state["exp_avg"], "exp_avg, kept in fp32")
    set_same_grads(2, into_masters)
    optimizer.step()  # and it trains on


def test_a_state_the_optimizer_did_not_create_is_refused_before_anything_changes() -> None:
    factory = FACTORIES["sgd_nesterov_wd"]
    params = make_params()
    optimizer = swapped(params, factory, SimBackend())
    train(MasterReference(make_params(), factory), optimizer, params, range(2))
    checkpoint = through_torch_save(optimizer.state_dict())
    checkpoint["state"][0]["extra"] = torch.zeros(3)
    before = {key: value.clone() for key, value in optimizer.state_dict()["state"][0].items()}
    with pytest.raises(StateDictMismatchError, match=r"'extra'.*SGD did not create"):
        optimizer.load_state_dict(checkpoint)
    for key, value in optimizer.state_dict()["state"][0].items():
        assert_bitwise_equal(before[key], value, f"{key} after the refused load")


class LerpOnEval(torch.optim.SGD):
    """A torch-only optimizer shaped like schedule-free's: ``train_mode`` in its groups, and ``train()``/``eval()``
    that move the parameters towards a state outside ``step()`` (schedule-free lerps them towards ``z``)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params, lr=1e-2, momentum=0.9)
        for group in self.param_groups:
            group["train_mode"] = True

    @torch.no_grad()
    def eval(self) -> None:
        self._switch(train_mode=False, weight=0.25)

    @torch.no_grad()
    def train(self) -> None:
        self._switch(train_mode=True, weight=0.1)

    def _switch(self, *, train_mode: bool, weight: float) -> None:
        for group in self.param_groups:
            if group["train_mode"] != train_mode:
                for param in group["params"]:
                    state = self.state[param]
                    if "momentum_buffer" in state:
                        param.lerp_(end=state["momentum_buffer"].to(param.device), weight=weight)
                group["train_mode"] = train_mode


def _schedule_free_factory() -> Factory:
    schedulefree = pytest.importorskip("schedulefree")

    def factory(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        optimizer: torch.optim.Optimizer = schedulefree.AdamWScheduleFree(params, lr=1e-2, warmup_steps=2)
        optimizer.train()  # type: ignore[attr-defined]  # schedule-free steps only in train mode
        return optimizer

    return factory


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("name", ["lerp_on_eval", "schedule_free_adamw"])
def test_train_and_eval_outside_step_run_on_the_masters_bitwise(name: str, packed: bool) -> None:
    """``eval()``/``train()`` (on the SwapOptimizer or on the wrapped optimizer) move the fp32 masters, as the plain
    optimizer over fp32 masters does, and the parameters follow; a pending prefetch is dropped first."""
    factory: Factory = LerpOnEval if name == "lerp_on_eval" else _schedule_free_factory()
    for mode, seed in MASTER_MODES:
        sim = SimBackend(mode=mode, seed=seed)  # type: ignore[arg-type]
        reference = MasterReference(make_params(), factory)
        params = make_params()
        optimizer = swapped(params, factory, sim, packed=packed)
        where = f"{name} {mode} {seed}"
        train(reference, optimizer, params, range(3))
        optimizer.prefetch()  # eval() changes host states: this copy-in must not be used
        allocated = sim.memory_allocated()
        for switch, entry in (("eval", optimizer), ("train", optimizer.optimizer), ("eval", optimizer.optimizer)):
            getattr(reference.optimizer, switch)()
            reference.copy_masters_to_params()
            getattr(entry, switch)()
            reference.assert_matches(optimizer, params, f"{where}: after {switch}()")
            assert [group["train_mode"] for group in optimizer.param_groups] == [
                group["train_mode"] for group in reference.optimizer.param_groups
            ]
            assert sim.memory_allocated() <= allocated, "staging of the outside-step call left on the device"
        assert not optimizer.prefetched
        optimizer.train()  # type: ignore[attr-defined]
        reference.optimizer.train()  # type: ignore[attr-defined]
        reference.copy_masters_to_params()
        train(reference, optimizer, params, range(3, 6))
        reference.assert_matches(optimizer, params, f"{where}: after 3 more steps")


def test_outside_step_methods_are_named_and_others_refused() -> None:
    params = make_params()
    optimizer = swapped(params, LerpOnEval, SimBackend(mode="random", seed=4))
    assert optimizer.adapter.outside_step_methods == ("train", "eval")
    with pytest.raises(ValueError, match=r"'zero_grad' is not a method run outside step\(\) for LerpOnEval"):
        optimizer.outside_step("zero_grad")
    plain = swapped(make_params(), FACTORIES["sgd_nesterov_wd"], SimBackend())
    assert plain.adapter.outside_step_methods == () and not hasattr(plain, "eval")


class WritesPerParameter(LerpOnEval):
    """An ``eval()`` that writes a group value depending on the group's parameters: it cannot run one parameter
    at a time."""

    @torch.no_grad()
    def eval(self) -> None:
        super().eval()
        for group in self.param_groups:
            group["seen"] = sum(param.numel() for param in group["params"])


def test_an_outside_step_method_writing_per_parameter_values_is_refused_and_the_groups_keep_the_first_writes() -> None:
    params = make_params()
    optimizer = swapped(params, WritesPerParameter, SimBackend(mode="lazy"))
    set_same_grads(0, params)
    optimizer.step()
    listed = optimizer.param_groups[0]["params"]
    first, second = params[0].numel(), params[1].numel()
    refused = rf"WritesPerParameter\.eval wrote param group 0's 'seen' as {first} for the first parameter and as "
    with pytest.raises(SwapStateError, match=refused + rf"{second} for parameter 1: it cannot run one parameter"):
        optimizer.eval()
    group = optimizer.param_groups[0]
    assert group["params"] is listed, "the groups list their parameters again"
    assert group["seen"] == first and group["train_mode"] is False, "the groups as the finished call left them"


class FailsOnFourthParameter(LerpOnEval):
    """An ``eval()`` that fails when it meets its fourth parameter (run one parameter at a time: its fourth call), an
    fp16 one whose states and master are swapped."""

    calls = 0

    @torch.no_grad()
    def eval(self) -> None:
        FailsOnFourthParameter.calls += 1
        if FailsOnFourthParameter.calls == 4:
            raise RuntimeError("eval failed")
        super().eval()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_an_outside_step_method_that_fails_keeps_the_failed_parameters_states_and_the_next_step_runs(
    packed: bool,
) -> None:
    """The failed parameter's device copies are dropped: its host mirrors and master are as before the call, its
    slots back in host memory, so the next step and the next ``eval()`` run."""
    FailsOnFourthParameter.calls = 0
    params = make_params()
    optimizer = swapped(params, FailsOnFourthParameter, SimBackend(mode="random", seed=3), packed=packed)
    set_same_grads(0, params)
    optimizer.step()
    failed = params[3]
    assert failed.dtype == torch.float16 and failed.numel() >= MIN_NUMEL
    before = {key: value.detach().clone() for key, value in optimizer.state[failed].items()}
    param_before = failed.detach().clone()
    with pytest.raises(RuntimeError, match="eval failed"):
        optimizer.eval()  # type: ignore[attr-defined]
    for key, value in optimizer.state[failed].items():
        assert_bitwise_equal(before[key], value, f"{key} of the parameter whose call failed")
    assert_bitwise_equal(param_before, failed, "the parameter whose call failed")
    optimizer.eval()  # type: ignore[attr-defined]
    optimizer.train()  # type: ignore[attr-defined]
    set_same_grads(1, params)
    optimizer.step()
    assert all(torch.isfinite(param).all() for param in params)


def test_an_outside_step_method_sees_a_state_replaced_since_the_last_step() -> None:
    """A state assigned between steps is what ``eval()`` lerps the master towards (the slots follow the edit
    first), as in the plain optimizer over fp32 masters."""
    params = make_params()
    optimizer = swapped(params, LerpOnEval, SimBackend(mode="lazy"))
    set_same_grads(0, params)
    optimizer.step()
    first = params[0]
    state = optimizer.state[first]
    master = state[MASTER_KEY].detach().clone()
    state["momentum_buffer"] = torch.zeros_like(master)
    optimizer.eval()  # type: ignore[attr-defined]
    expected = torch.lerp(master, torch.zeros_like(master), 0.25)
    assert_bitwise_equal(expected, optimizer.state[first][MASTER_KEY], "the master after eval()")
    assert_bitwise_equal(expected.to(first.dtype), first, "the parameter follows its master")


def test_an_outside_step_method_over_dtensor_parameters_sees_its_sharded_states_as_dtensors() -> None:
    """A 1-rank mesh (every rank does the same on its shard): ``eval()`` over the masters of DTensor parameters gets
    each swapped state as the DTensor it is between steps, and matches the plain optimizer over fp32 masters."""
    from torch.distributed.device_mesh import init_device_mesh

    from swap_core.testing.distributed import initialized_process_group

    def run() -> None:
        mesh = init_device_mesh("cpu", (1,))
        params, reference_params = sharded_on(mesh, make_params(5)), sharded_on(mesh, make_params(5))
        reference = MasterReference(reference_params, LerpOnEval)
        optimizer = swapped(params, LerpOnEval, SimBackend(mode="random", seed=5))
        for step in range(2):
            set_same_grads(step, params, reference_params)
            optimizer.step()
            reference.step()
        reference.optimizer.eval()  # type: ignore[attr-defined]
        reference.copy_masters_to_params()
        optimizer.eval()  # type: ignore[attr-defined]
        reference.assert_matches(optimizer, params, "after eval() over DTensor masters")

    with initialized_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1):
        run()


BNB_SHAPES_AND_DTYPES = (((128, 64), torch.bfloat16), ((8192,), torch.float16), ((16,), torch.float32))
"""At least 4,096 elements get 8-bit states (bitsandbytes' min_8bit_size); the last stays 32-bit."""


@pytest.mark.parametrize("name", ["AdamW8bit", "Lion8bit"])
def test_bitsandbytes_over_masters_bitwise_and_its_own_load_keeps_them_fp32(name: str) -> None:
    """bitsandbytes' own load_state_dict casts floating states to the parameter's dtype: it loads over fp32
    stand-ins of the parameters, so masters and states stay fp32 as in the reference."""
    bnb = pytest.importorskip("bitsandbytes")

    def factory(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        optimizer: torch.optim.Optimizer = getattr(bnb.optim, name)(params, lr=1e-3)
        return optimizer

    reference = MasterReference(mixed_precision_params(0, BNB_SHAPES_AND_DTYPES), factory)
    params = mixed_precision_params(0, BNB_SHAPES_AND_DTYPES)
    optimizer = swapped(params, factory, SimBackend(mode="random", seed=6))
    train(reference, optimizer, params, range(3))
    reference.assert_matches(optimizer, params, "after 3 steps")
    assert optimizer.state[params[0]]["state1"].dtype == torch.uint8, "8-bit codes stay uint8"

    resumed_params = [torch.nn.Parameter(param.detach().clone()) for param in params]
    resumed = swapped(resumed_params, factory, SimBackend(mode="random", seed=7))
    resumed.load_state_dict(through_torch_save(optimizer.state_dict()))
    assert resumed.state[resumed_params[0]][MASTER_KEY].dtype == torch.float32
    train(reference, resumed, resumed_params, range(3, 5))
    reference.assert_matches(resumed, resumed_params, "resumed through bitsandbytes' own load, 2 steps on")


def test_a_deep_copy_with_master_weights_steps_and_switches_as_the_original() -> None:
    """The copy's adapter reads the copied states without the masters (before: 'lacks master_param'); its eval()
    and train(), on it or on its wrapped optimizer, are its own."""
    reference = MasterReference(make_params(), LerpOnEval)
    optimizer = swapped(make_params(), LerpOnEval, SimBackend(mode="random", seed=4))
    params = list(optimizer.param_groups[0]["params"])
    train(reference, optimizer, params, range(2))
    twin = copy.deepcopy(optimizer)
    twin_params = list(twin.param_groups[0]["params"])
    twin.eval()  # type: ignore[operator]
    assert all(not group["train_mode"] for group in twin.param_groups)
    assert all(group["train_mode"] for group in optimizer.param_groups)
    twin.optimizer.train()  # type: ignore[operator]
    reference.assert_matches(optimizer, params, "the original after the twin's eval() and train()")
    twin_reference = copy.deepcopy(reference)
    for name in ("eval", "train"):
        getattr(twin_reference.optimizer, name)()
        twin_reference.copy_masters_to_params()
    train(twin_reference, twin, twin_params, range(2, 4))
    train(reference, optimizer, params, range(2, 4))
    twin_reference.assert_matches(twin, twin_params, "the twin after its own switches and steps")
    reference.assert_matches(optimizer, params, "the original after 4 steps")


class RaisesOnOneShape(torch.optim.SGD):
    """SGD with momentum whose step raises on the (30, 30) parameter (fp16: stepped as its fp32 master) while ``fail``
    is set: a check only a later batch trips, after the batches before it created their momentum buffers."""

    fail = True

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params, lr=0.05, momentum=0.9)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                if self.fail and tuple(param.shape) == (30, 30):
                    raise ValueError(f"a parameter of shape {tuple(param.shape)}")
        return super().step(closure)


@pytest.mark.parametrize("undo", [False, True], ids=["first_step_undo", "undo_failed_steps"])
@pytest.mark.parametrize("retry", ["at_once", "after_del_state"])
def test_a_failed_first_step_is_undone_and_a_retry_steps_bitwise_as_the_plain_optimizer_over_masters(
    retry: str, undo: bool
) -> None:
    """Issue 44, item 7: the first step fails in a later batch and is undone (the masters stay in the state, the
    states the earlier batches created go); the retry, at once or after ``del optimizer.state[p]`` as the error
    said, steps as the plain optimizer over fp32 masters. Before: every retry was refused ("lacks
    'momentum_buffer'"): the state check asked the adapter about a state holding only its master."""
    params = make_params()
    optimizer = swapped(params, RaisesOnOneShape, SimBackend(mode="random", seed=3), undo_failed_steps=undo)
    before = [param.detach().clone() for param in params]
    set_same_grads(0, params)
    with pytest.raises(ValueError, match=r"a parameter of shape \(30, 30\)"):
        optimizer.step()
    for index, (expected, param) in enumerate(zip(before, params, strict=True)):
        assert_bitwise_equal(expected, param, f"parameter {index} after the failed step")
        assert "momentum_buffer" not in optimizer.state.get(param, {}), f"parameter {index}'s state"
    if retry == "after_del_state":
        for param in params:
            optimizer.state.pop(param, None)
    optimizer.optimizer.fail = False  # type: ignore[attr-defined]
    reference = MasterReference(make_params(), RaisesOnOneShape)
    reference.optimizer.fail = False  # type: ignore[attr-defined]
    for step in range(3):
        train(reference, optimizer, params, range(step, step + 1))
        reference.assert_matches(optimizer, params, f"step {step} after the failed first step")


def test_sgd_with_momentum_moves_6_125_bytes_a_bf16_parameter_each_way() -> None:
    """Issue 46: the momentum (4 B) and the master as the bits its bf16 parameter lacks (2.125 B), at most 6.25
    bytes a parameter each way, exactly counted; bitwise the reference."""
    factory = FACTORIES["sgd_nesterov_wd"]
    generator = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(256, generator=generator).bfloat16()) for _ in range(4)]
    reference = MasterReference([param.detach().clone() for param in params], factory)
    optimizer = swapped(params, factory, SimBackend(mode="lazy"), packed=False)
    train(reference, optimizer, params, range(3))
    reference.assert_matches(optimizer, params, "3 steps")
    moved = 4 * (4 * 256 + remainder_nbytes(256))
    assert optimizer.stats.h2d_bytes == optimizer.stats.d2h_bytes == moved
    assert moved / (4 * 256) == 6.125 <= 6.25
