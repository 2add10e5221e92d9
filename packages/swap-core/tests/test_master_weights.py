"""SwapConfig(master_weights=True): fp32 masters of bf16/fp16 parameters as swapped state, bitwise the reference.

The reference (swap_core.testing.masters.MasterReference) is the plain optimizer over fp32 leaf
copies of the low-precision parameters, each step ``m.grad = p.grad.float()``, ``step()``,
``p.copy_(m)``. Here the family is core's RMSprop; swap-adam's tests hold Adam and AdamW to the same.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.backends.cpu import CpuBackend
from swap_core.errors import StateDictMismatchError, SwapStateError, UnsupportedOptimizerError
from swap_core.master_weights import MASTER_KEY, master_of, master_state_dict
from swap_core.master_weights.remainder import remainder_nbytes
from swap_core.runtime.state_keys import REMAINDER_KEY
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_core.testing.conformance import through_torch_save
from swap_core.testing.masters import (
    MIXED_SHAPES_AND_DTYPES,
    MasterReference,
    mixed_precision_params,
    set_same_grads,
    sharded_on,
)

pytestmark = pytest.mark.sim_only

SHAPES_AND_DTYPES = MIXED_SHAPES_AND_DTYPES
STEPS = 10
Factory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def rmsprop(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(params, lr=1e-2, momentum=0.9, centered=True, weight_decay=0.01)


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    return mixed_precision_params(seed)


def swapped(
    params: list[torch.nn.Parameter], backend: SimBackend, factory: Factory = rmsprop, **options: Any
) -> SwapOptimizer:
    config = SwapConfig(backend=backend, swap_times=2, min_numel=64, master_weights=True, **options)
    return swap_optimizer(factory(list(params)), config)


def master_bytes(param: torch.Tensor) -> int:
    """Bytes of ``param``'s master: its remainder for a bf16 one (2.125 a parameter), fp32 for an fp16 one."""
    if param.dtype == torch.bfloat16:
        return remainder_nbytes(param.numel())
    return 4 * param.numel() if param.dtype == torch.float16 else 0


def assert_matches_reference(reference: MasterReference, optimizer: SwapOptimizer, where: str) -> None:
    reference.assert_matches(optimizer, optimizer.param_groups[0]["params"], where)


def train(reference: MasterReference, optimizer: SwapOptimizer, steps: range) -> None:
    for step in steps:
        reference.set_grads(step, optimizer.param_groups[0]["params"])
        reference.step()
        optimizer.step()


# -- bitwise the reference -------------------------------------------------------------------
def test_states_and_masters_are_fp32_and_the_params_keep_their_dtype() -> None:
    params = make_params()
    optimizer = swapped(params, SimBackend())
    set_same_grads(0, params)
    optimizer.step()
    optimizer.synchronize()  # host mirrors are read: the last offload must have run
    for param, (_, dtype) in zip(params, SHAPES_AND_DTYPES, strict=True):
        assert param.dtype == dtype
        state = optimizer.state[param]
        # bf16: the master's remainder (uint8, 2.125 bytes a parameter); fp16: an fp32 master; fp32: none.
        assert (MASTER_KEY in state) is (dtype == torch.float16) and (REMAINDER_KEY in state) is (
            dtype == torch.bfloat16
        )
        assert {state[key].dtype for key in ("square_avg", "momentum_buffer", "grad_avg")} == {torch.float32}
        if REMAINDER_KEY in state:
            assert state[REMAINDER_KEY].dtype == torch.uint8
            assert state[REMAINDER_KEY].shape == (remainder_nbytes(param.numel()),)
        master = master_of(optimizer, param)
        if master is not None:
            assert master.dtype == torch.float32 and master.shape == param.shape
            assert torch.equal(master.to(dtype), param.detach().cpu()), "the parameter is its master, rounded"


# -- memory, exact on the simulator ----------------------------------------------------------------
def test_between_steps_no_master_or_swapped_state_byte_is_on_the_device() -> None:
    sim = SimBackend()
    params = make_params()
    optimizer = swapped(params, sim, packed=False)
    for step in range(3):
        set_same_grads(step, params)
        optimizer.step()
        sim.synchronize()
        assert sim.memory_allocated() == optimizer.stats.resident_state_device_bytes
    swapped_numel = sum(param.numel() for param in params if param.numel() >= 64)
    masters = sum(master_bytes(param) for param in params if param.numel() >= 64)
    # Per parameter: RMSprop's square_avg, momentum_buffer, grad_avg in fp32 (12 B), and the master: its remainder
    # for bf16 (2.125 B), fp32 for fp16 (4 B).
    assert optimizer.stats.host_state_bytes == 12 * swapped_numel + masters
    resident = params[1]  # (40,) bf16: three states and its master's remainder stay on the device
    assert optimizer.stats.resident_state_device_bytes == 12 * resident.numel() + master_bytes(resident)


# -- checkpoints -----------------------------------------------------------------------------------
def test_a_master_checkpoint_resumes_bitwise_and_loads_into_the_plain_optimizer() -> None:
    reference = MasterReference(make_params(), rmsprop)
    optimizer = swapped(make_params(), SimBackend(mode="random", seed=1))
    train(reference, optimizer, range(4))
    checkpoint = through_torch_save(optimizer.state_dict())
    assert checkpoint["state"][0][MASTER_KEY].dtype == torch.float32

    resumed_params = [param.detach().clone().requires_grad_() for param in optimizer.param_groups[0]["params"]]
    resumed = swapped([torch.nn.Parameter(param) for param in resumed_params], SimBackend(mode="random", seed=2))
    resumed.load_state_dict(checkpoint)
    assert_matches_reference(reference, resumed, "resumed")
    train(reference, resumed, range(4, 8))
    assert_matches_reference(reference, resumed, "resumed, 4 steps on")

    # torch's own load keeps the extra key and casts every state to the parameter's dtype (documented).
    plain_params = make_params()
    plain = rmsprop(list(plain_params))
    plain.load_state_dict(checkpoint)
    assert plain.state[plain_params[0]][MASTER_KEY].dtype == torch.bfloat16


def test_a_plain_checkpoint_loads_into_master_mode_with_masters_from_the_params() -> None:
    plain_params = make_params()
    plain = rmsprop(list(plain_params))
    for step in range(3):
        set_same_grads(step, plain_params)
        plain.step()
    params = [torch.nn.Parameter(param.detach().clone()) for param in plain_params]
    optimizer = swapped(params, SimBackend())
    with pytest.warns(UserWarning, match=r"no 'master_param' for 4 bfloat16/float16 parameter\(s\)"):
        optimizer.load_state_dict(through_torch_save(plain.state_dict()))
    for param, plain_param in zip(params, plain_params, strict=True):
        state, plain_state = optimizer.state[param], plain.state[plain_param]
        if param.dtype != torch.float32:
            assert_bitwise_equal(param.detach().float(), master_of(optimizer, param), "master from the parameter")
        for key in ("square_avg", "momentum_buffer", "grad_avg"):
            assert state[key].dtype == torch.float32, "kept in fp32 beside a master"
            assert_bitwise_equal(plain_state[key].float(), state[key], key)
    set_same_grads(3, params)
    optimizer.step()  # and it trains on


def test_a_master_checkpoint_is_refused_without_master_weights_and_nothing_changes() -> None:
    optimizer = swapped(make_params(), SimBackend())
    set_same_grads(0, optimizer.param_groups[0]["params"])
    optimizer.step()
    checkpoint = through_torch_save(optimizer.state_dict())
    params = make_params()
    plain_mode = swap_optimizer(rmsprop(list(params)), SwapConfig(backend=SimBackend(), swap_times=2, min_numel=64))
    set_same_grads(0, params)
    plain_mode.step()
    before = through_torch_save(plain_mode.state_dict())
    with pytest.raises(StateDictMismatchError, match=r"saved with master_weights=True.*master_weights=True\)"):
        plain_mode.load_state_dict(checkpoint)
    assert_state_dicts_equal(before, plain_mode.state_dict(), "state after the refused load")


def test_a_checkpoint_with_a_wrongly_shaped_master_is_refused_and_nothing_changes() -> None:
    optimizer = swapped(make_params(), SimBackend())
    set_same_grads(0, optimizer.param_groups[0]["params"])
    optimizer.step()
    checkpoint = through_torch_save(optimizer.state_dict())
    before = through_torch_save(optimizer.state_dict())
    checkpoint["state"][0][MASTER_KEY] = torch.zeros(3, 3)
    with pytest.raises(StateDictMismatchError, match=r"parameter 0 .*master_param"):
        optimizer.load_state_dict(checkpoint)
    assert_state_dicts_equal(before, optimizer.state_dict(), "state after the refused load")


def test_a_load_through_the_wrapped_optimizer_casting_masters_is_refused_at_the_next_step() -> None:
    optimizer = swapped(make_params(), SimBackend())
    params = optimizer.param_groups[0]["params"]
    set_same_grads(0, params)
    optimizer.step()
    checkpoint = through_torch_save(optimizer.state_dict())
    optimizer.optimizer.load_state_dict(checkpoint)  # torch's own load: every state cast to bf16
    before = [param.detach().clone() for param in params]
    set_same_grads(1, params)
    with pytest.raises(
        SwapStateError, match=r"'master_param' of torch.bfloat16.*load checkpoints through the SwapOptimizer"
    ):
        optimizer.step()
    for param, saved in zip(params, before, strict=True):
        assert_bitwise_equal(saved, param, "parameter after the refused step")


# -- refused clearly -------------------------------------------------------------------------------
def test_master_weights_on_cpu_parameters_run_the_same_math_unswapped() -> None:
    """backend='auto' with CPU parameters: the runtime runs on the CPU (CpuBackend), nothing swapped, bitwise
    the same reference as on a swap backend; a checkpoint keeps masters and states fp32 there too."""
    params = make_params()
    reference = MasterReference(make_params(), rmsprop)
    optimizer = swap_optimizer(rmsprop(list(params)), SwapConfig(master_weights=True))
    assert isinstance(optimizer.backend, CpuBackend) and "backend=cpu" in repr(optimizer)
    for step in range(STEPS):
        train(reference, optimizer, range(step, step + 1))
        assert_matches_reference(reference, optimizer, f"CPU step {step}")
    assert optimizer.stats.host_state_bytes == 0 and optimizer.stats.h2d_copies == 0, "nothing is swapped"
    masters = sum(master_bytes(param) for param in params)
    assert optimizer.stats.resident_state_device_bytes == 12 * sum(param.numel() for param in params) + masters

    checkpoint = through_torch_save(optimizer.state_dict())
    resumed_params = [torch.nn.Parameter(param.detach().clone()) for param in params]
    resumed = swap_optimizer(rmsprop(list(resumed_params)), SwapConfig(master_weights=True))
    resumed.load_state_dict(checkpoint)
    assert resumed.state[resumed_params[0]][REMAINDER_KEY].dtype == torch.uint8, "bf16: kept as its remainder"
    assert resumed.state[resumed_params[0]]["square_avg"].dtype == torch.float32, "not cast to the bf16 parameter's"
    train(reference, resumed, range(STEPS, STEPS + 2))
    reference.assert_matches(resumed, resumed_params, "CPU, resumed")


def test_master_weights_with_fp32_parameters_only_makes_no_master() -> None:
    params = [torch.nn.Parameter(torch.randn(32, 32))]
    optimizer = swap_optimizer(rmsprop(list(params)), SwapConfig(master_weights=True))  # CPU, unswapped: nothing to do
    params[0].grad = torch.ones(32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
    assert MASTER_KEY not in optimizer.state[params[0]]


def test_a_bf16_group_added_to_a_cpu_master_mode_optimizer_gets_masters() -> None:
    fp32 = torch.nn.Parameter(torch.randn(8))
    optimizer = swap_optimizer(rmsprop([fp32]), SwapConfig(master_weights=True))
    added = torch.nn.Parameter(torch.randn(8, 8).bfloat16())
    optimizer.add_param_group({"params": [added]})
    fp32.grad, added.grad = torch.ones(8), torch.ones(8, 8).bfloat16()
    optimizer.step()
    assert optimizer.state[added][REMAINDER_KEY].dtype == torch.uint8
    assert REMAINDER_KEY not in optimizer.state[fp32] and MASTER_KEY not in optimizer.state[fp32]


def test_master_weights_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="master_weights"):
        SwapConfig(master_weights="yes")  # type: ignore[arg-type]


def test_master_state_dict_exports_the_fp32_masters_keyed_like_the_model() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    model[0].to(torch.bfloat16)
    model[2].to(torch.float16)
    reference_model = copy.deepcopy(model)
    reference = MasterReference(list(reference_model.parameters()), rmsprop)
    optimizer = swapped(list(model.parameters()), SimBackend(mode="random", seed=4))
    for step in range(3):
        reference.set_grads(step, list(model.parameters()))
        reference.step()
        optimizer.step()
    exported = master_state_dict(model, optimizer)
    assert list(exported) == list(model.state_dict())
    for (name, param), master in zip(model.named_parameters(), reference.masters, strict=True):
        assert exported[name].dtype == torch.float32 and exported[name].device.type == "cpu"
        assert_bitwise_equal(master, exported[name], name)  # the fp32 master (the LayerNorm: its own fp32 values)
        if param.dtype != torch.float32:
            assert exported[name].data_ptr() != master_of(optimizer, param).data_ptr(), "a copy"


class _TiedModel(torch.nn.Module):
    """An embedding and a head sharing one weight (tied), and a bf16 layer that never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16).bfloat16()
        self.frozen = torch.nn.Linear(16, 16).bfloat16()
        self.head = torch.nn.Linear(16, 32, bias=False).bfloat16()
        self.head.weight = self.emb.weight


def test_master_state_dict_gives_every_name_of_a_tied_weight_its_master_and_exports_one_dtype() -> None:
    model = _TiedModel()
    params = [model.emb.weight, *model.frozen.parameters()]
    optimizer = swapped(params, SimBackend(mode="lazy"))
    for _ in range(2):
        model.emb.weight.grad = torch.full_like(model.emb.weight, 0.5)
        optimizer.step()
    exported = master_state_dict(model, optimizer)
    master = master_of(optimizer, model.emb.weight)
    for name in ("emb.weight", "head.weight"):
        assert_bitwise_equal(master, exported[name], f"{name}: the tied weight's fp32 master, under both names")
    assert not torch.equal(exported["emb.weight"], model.emb.weight.float()), "the master moved off the bf16 grid"
    for name in ("frozen.weight", "frozen.bias"):  # never stepped: no master, its own values in fp32
        assert_bitwise_equal(model.get_parameter(name).float(), exported[name], name)
    assert {value.dtype for value in exported.values()} == {torch.float32}


def test_a_checkpoint_whose_masters_were_cast_down_loads_them_as_fp32_with_a_warning() -> None:
    params = [torch.nn.Parameter(torch.randn(16, 8).bfloat16()) for _ in range(2)]
    optimizer = swapped(params, SimBackend(mode="lazy"))
    for param in params:
        param.grad = torch.full_like(param, 0.25)
    optimizer.step()
    saved = optimizer.state_dict()
    for entry in saved["state"].values():
        entry[MASTER_KEY] = entry[MASTER_KEY].bfloat16()  # saved in the model's dtype
    with pytest.warns(UserWarning, match=r"holds 2 'master_param' in a lower precision than float32"):
        optimizer.load_state_dict(saved)
    assert all(master_of(optimizer, param).dtype == torch.float32 for param in params)  # type: ignore[union-attr]


def test_master_weights_over_dtensor_parameters_are_sharded_like_them_and_match_the_reference() -> None:
    """A 1-rank mesh here (every rank does the same on its shard): the master of a DTensor parameter is an fp32
    DTensor of its layout whose local shard is swapped; the multi-rank runs and their DCP checkpoints are
    swap-ckpt's ``test_ckpt_fsdp_masters.py``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from swap_core.testing.distributed import initialized_process_group

    def run() -> None:
        mesh = init_device_mesh("cpu", (1,))
        params, reference_params = sharded_on(mesh, make_params(7)), sharded_on(mesh, make_params(7))
        reference = MasterReference(reference_params, rmsprop)
        optimizer = swapped(params, SimBackend(mode="random", seed=7))
        for step in range(4):
            set_same_grads(step, params, reference_params)
            optimizer.step()
            reference.step()
            reference.assert_matches(optimizer, params, f"step {step}")
        for param in params:
            if param.dtype != torch.float32:
                master = master_of(optimizer, param)  # a bf16 one's joined from its local remainder
                assert isinstance(master, DTensor) and master.placements == param.placements
                assert master.dtype == torch.float32 and master.shape == param.shape
                assert (REMAINDER_KEY in optimizer.state[param]) is (param.dtype == torch.bfloat16)
        checkpoint = optimizer.state_dict()  # the fp32 master, a DTensor of the parameter's layout, in either form
        masters = [entry[MASTER_KEY] for entry in checkpoint["state"].values() if MASTER_KEY in entry]
        assert len(masters) == 4 and all(isinstance(master, DTensor) for master in masters)

    with initialized_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1):
        run()


def test_master_weights_refuse_an_adapter_that_cannot_run_on_masters_naming_why() -> None:
    from swap_core.adapters.rmsprop import RMSpropAdapter

    class NamedReason(RMSpropAdapter):
        master_weights_unsupported = "it keeps a copy of every parameter"

    class ReasonOfItsOptimizer(RMSpropAdapter):  # e.g. swap-generic, for schedule-free optimizers
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            super().__init__(optimizer)
            self.master_weights_unsupported = f"its {type(optimizer).__name__} moves the parameters itself"

    for adapter, reason in ((NamedReason, "it keeps a copy of every parameter"), (ReasonOfItsOptimizer, "RMSprop")):
        params = make_params()
        plain = rmsprop(list(params))
        config = SwapConfig(backend=SimBackend(), master_weights=True)
        with pytest.raises(UnsupportedOptimizerError, match=rf"through {adapter.__name__}: .*{reason}") as raised:
            SwapOptimizer(plain, config, adapter_factory=adapter)
        assert "master_weights=False" in str(raised.value)
        assert not plain.state and not plain._optimizer_step_pre_hooks
        SwapOptimizer(plain, SwapConfig(backend=SimBackend()), adapter_factory=adapter)  # without masters: fine


def test_states_made_before_wrapping_get_masters_from_the_params_with_one_warning() -> None:
    """An optimizer stepped before wrapping holds bf16/fp16 states: taken as a plain checkpoint is loaded."""
    params = make_params()
    plain = rmsprop(list(params))
    set_same_grads(0, params)
    plain.step()  # states in the parameters' dtypes
    reference = MasterReference([param.detach().clone() for param in params], rmsprop)
    reference.optimizer.load_state_dict(plain.state_dict())  # torch casts them to the masters' fp32
    config = SwapConfig(backend=SimBackend(mode="random", seed=2), swap_times=2, min_numel=64, master_weights=True)
    with pytest.warns(
        UserWarning, match=r"^4 bfloat16/float16 parameter\(s\) had optimizer states before wrapping"
    ) as said:
        optimizer = swap_optimizer(plain, config)
    assert said[0].filename == __file__, "the warning points at the line that wrapped the optimizer"
    low = [param for param in params if param.dtype != torch.float32]
    floating = {key: value.dtype for param in low for key, value in optimizer.state[param].items() if key != "step"}
    assert {dtype for key, dtype in floating.items() if key != REMAINDER_KEY} == {torch.float32}
    reference.assert_matches(optimizer, params, "wrapped")
    train(reference, optimizer, range(1, 4))
    reference.assert_matches(optimizer, params, "after three steps of the wrapped optimizer")


def test_an_outside_step_method_the_class_lacks_is_refused_before_anything_changes() -> None:
    from swap_core.adapters.rmsprop import RMSpropAdapter

    class DeclaresEval(RMSpropAdapter):
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            super().__init__(optimizer)
            self.outside_step_methods = ("eval",)

    params = make_params()
    plain = rmsprop(list(params))
    plain_state = plain.state
    with pytest.raises(TypeError, match=r"declares 'eval' as a method of RMSprop run outside step\(\)"):
        SwapOptimizer(plain, SwapConfig(backend=SimBackend(), master_weights=True), adapter_factory=DeclaresEval)
    assert plain.state is plain_state and not plain.state and "eval" not in vars(plain)
