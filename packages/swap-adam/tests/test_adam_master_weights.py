"""Adam and AdamW with SwapConfig(master_weights=True): bitwise the plain optimizer over fp32 masters.

The reference is swap_core.testing.masters.MasterReference (the optimizer over fp32 leaf copies of
the bf16/fp16 parameters, ``m.grad = p.grad.float()``, ``step()``, ``p.copy_(m)``), for every
implementation torch has (single-tensor, foreach, fused) and the options that change the math.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from swap_core import DeviceBackend, SwapConfig, swap_optimizer
from swap_core.master_weights import REMAINDER_KEY
from swap_core.master_weights.remainder import remainder_nbytes
from swap_core.sim import SimBackend
from swap_core.testing.masters import MasterReference, set_same_grads
from swap_core.testing.pytest_plugin import BackendFactory

STEPS = 10
SHAPES = ((64, 48), (48,), (33, 17), (8,), (40, 40))
"""(48,) and (8,) are under min_numel=64: their moments and masters stay resident on the device."""

OPTIONS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adam_foreach": lambda params: torch.optim.Adam(params, lr=1e-2, foreach=True, weight_decay=0.01),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
    "adam_amsgrad": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True),
    "adamw_maximize": lambda params: torch.optim.AdamW(params, lr=1e-2, maximize=True, foreach=False),
    "adamw_tensor_lr": lambda params: torch.optim.AdamW(params, lr=torch.tensor(1e-2), foreach=False),
}
MODES = (("lazy", 0), ("sync", 0), ("random", 0), ("random", 1), ("random", 2))


def _params(dtype: torch.dtype, device: torch.device | str = "cpu") -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]
    values[2] = values[2].float()  # an fp32 parameter beside them keeps no master
    return [torch.nn.Parameter(value.to(device)) for value in values]


def _train_against_the_reference(
    option: str, dtype: torch.dtype, backend: DeviceBackend, where: str, **config: Any
) -> None:
    """STEPS steps of OPTIONS[option], swapped with master weights and as the reference, compared after each."""
    factory = OPTIONS[option]
    reference = MasterReference(_params(dtype, backend.device), factory)
    params = _params(dtype, backend.device)
    swap = SwapConfig(backend=backend, swap_times=3, min_numel=64, master_weights=True, **config)
    optimizer = swap_optimizer(factory(list(params)), swap)
    for step in range(STEPS):
        reference.set_grads(step, params)
        reference.step()
        optimizer.step()
        reference.assert_matches(optimizer, params, f"{where} step {step}")
    assert optimizer.stats.h2d_bytes > 0


@pytest.mark.sim_only
def test_adamw_moves_10_125_bytes_per_bf16_parameter_each_way_and_holds_none_on_the_device() -> None:
    """Issue 46: the master crosses the link as the bits its bf16 parameter lacks (2.125 bytes, at most 10.25 a
    parameter each way with the moments' 8), exactly counted, and between steps nothing is on the device."""
    params = [torch.nn.Parameter(torch.randn(1000).bfloat16()) for _ in range(4)]
    sim = SimBackend()
    config = SwapConfig(backend=sim, swap_times=2, packed=False, min_numel=64, master_weights=True)
    optimizer = swap_optimizer(torch.optim.AdamW(params, lr=1e-3), config)
    for step in range(3):
        set_same_grads(step, params)
        optimizer.step()
        sim.synchronize()
        assert sim.memory_allocated() == 0, "between steps no master or moment byte is on the device"
        assert optimizer.stats.h2d_bytes == optimizer.stats.d2h_bytes == 4 * (8 * 1000 + 2125)
    per_parameter = optimizer.stats.h2d_bytes / 4000
    assert per_parameter == 10.125 <= 10.25, "exp_avg and exp_avg_sq (8 B) and the master's remainder (2.125 B)"
    assert optimizer.stats.host_state_bytes == 4 * (8 * 1000 + remainder_nbytes(1000))
    assert optimizer.stats.peak_state_device_bytes == 2 * 2 * (8 * 1000 + 2125)  # two batches of two in flight
    assert all(optimizer.state[param][REMAINDER_KEY].dtype == torch.uint8 for param in params)


def test_bf16_moments_without_master_weights_differ_from_the_reference() -> None:
    # What master weights exist for: plain AdamW on bf16 parameters keeps bf16 moments and loses the small updates.
    factory: Callable[[list[torch.Tensor]], Any] = OPTIONS["adamw"]
    reference = MasterReference(_params(torch.bfloat16), factory)
    params = _params(torch.bfloat16)
    plain = factory(list(params))
    for step in range(STEPS):
        reference.set_grads(step, params)
        reference.step()
        plain.step()
    assert plain.state[params[0]]["exp_avg"].dtype == torch.bfloat16
    assert not torch.equal(reference.params[0], params[0]), "bf16 moments happened to give the fp32-master result"


@pytest.mark.sim_only
@pytest.mark.parametrize(("mode", "seed"), MODES, ids=[f"{mode}{seed}" for mode, seed in MODES])
def test_fp16_master_weights_with_grad_scaler_and_fused_adamw_skip_inf_steps_bitwise(mode: str, seed: int) -> None:
    # GradScaler hands a fused optimizer the scale: the fused kernel unscales the fp32 master gradients and skips
    # the step on inf, as it does for the reference over masters. (A non-fused optimizer has GradScaler unscale
    # the fp16 gradients themselves, which torch refuses: "Attempting to unscale FP16 gradients".)
    factory = OPTIONS["adamw_fused"]
    reference = MasterReference(_params(torch.float16), factory)
    params = _params(torch.float16)
    config = SwapConfig(backend=SimBackend(mode=mode, seed=seed), swap_times=3, min_numel=64, master_weights=True)  # type: ignore[arg-type]
    optimizer = swap_optimizer(factory(list(params)), config)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    for step in range(8):
        reference.set_grads(step, params)
        if step == 3:  # an overflow: both skip the update and halve the scale
            reference.params[0].grad[0, 0] = params[0].grad[0, 0] = float("inf")
        for scaler in scalers:
            scaler.scale(torch.ones(()))  # marks the iteration as scaled (the gradients above stand for scaled ones)
        reference.copy_grads_to_masters()
        scalers[0].step(reference.optimizer)
        reference.copy_masters_to_params()
        scalers[1].step(optimizer)
        for scaler in scalers:
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        reference.assert_matches(optimizer, params, f"{mode}{seed} step {step}")
    assert scalers[1].get_scale() == 2.0**9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("option", ["adamw", "adam_foreach", "adamw_fused"])
def test_master_weights_on_the_selected_backend(
    option: str, dtype: torch.dtype, swap_backend_factory: BackendFactory
) -> None:
    # The simulator by default; on a machine with an accelerator, --backend cuda|npu runs it there
    # (tools/device-check.sh), the reference's masters on the same device.
    backend = swap_backend_factory(mode="random", seed=3)
    _train_against_the_reference(option, dtype, backend, f"{option} {dtype} on {type(backend).__name__}")
