"""Single-process Muon with SwapConfig(master_weights=True): bitwise torch's Muon over fp32 masters.

The reference is swap_core.testing.masters.MasterReference: ``torch.optim.Muon`` over fp32 leaf
copies of bf16 matrices, ``m.grad = p.grad.float()``, ``step()``, ``p.copy_(m)``. The momentum
and the master of each matrix are fp32 state, swapped together.
"""

from __future__ import annotations

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.master_weights import master_of
from swap_core.master_weights.remainder import remainder_nbytes
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal
from swap_core.testing.masters import MasterReference

pytestmark = pytest.mark.sim_only

SHAPES = ((32, 24), (24, 24), (16, 40), (8, 8))
"""(8, 8) is under min_numel=128: its momentum and master stay resident on the device."""
MODES = (("lazy", 0), ("sync", 0), ("random", 0), ("random", 1))


def _params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).bfloat16()) for shape in SHAPES]


def _muon(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Muon(params, lr=2e-2, momentum=0.95, weight_decay=0.1, nesterov=True)


def test_distributed_muon_with_master_weights_on_one_rank_is_bitwise_the_reference() -> None:
    """Owner-rank Muon over DTensor parameters updates the shard masters (one rank here; two, and a 2 x 2 HSDP
    mesh with a checkpoint round trip, are test_distributed_muon.py's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from swap_core.testing.distributed import initialized_process_group
    from swap_muon.distributed import DistributedMuonAdapter

    def run() -> None:
        mesh = init_device_mesh("cpu", (1,))
        reference = MasterReference(_params(), _muon)
        params = [torch.nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])) for param in _params()]
        config = SwapConfig(backend=SimBackend(mode="random", seed=3), min_numel=128, master_weights=True)
        optimizer = swap_optimizer(_muon(list(params)), config)
        assert isinstance(optimizer.adapter, DistributedMuonAdapter)
        for step in range(4):
            generator = torch.Generator().manual_seed(step)
            for param, reference_param in zip(params, reference.params, strict=True):
                grad = torch.randn(param.shape, generator=generator).bfloat16()
                reference_param.grad = grad.clone()
                param.grad = distribute_tensor(grad, mesh, [Shard(0)])
            reference.step()
            optimizer.step()
            optimizer.synchronize()
            for index, (param, reference_param, master) in enumerate(
                zip(params, reference.params, reference.masters, strict=True)
            ):
                state = optimizer.state[param]
                where = f"step {step}, parameter {index}"
                assert_bitwise_equal(reference_param, param.full_tensor(), where)  # type: ignore[attr-defined]
                held = master_of(optimizer, param)  # the shard's remainder joined with it, as an fp32 DTensor
                assert held is not None
                assert_bitwise_equal(master, held.full_tensor(), f"{where}: master")
                momentum = reference.optimizer.state[master]["momentum_buffer"]
                assert_bitwise_equal(momentum, state["momentum_buffer"], f"{where}: momentum (fp32, whole)")

    with initialized_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1):
        run()


def test_muon_moves_6_125_bytes_a_bf16_parameter_each_way() -> None:
    """Issue 46: the momentum (4 B) and the master as the bits its bf16 parameter lacks (2.125 B), at most 6.25
    bytes a parameter each way, exactly counted; bitwise the reference."""
    reference = MasterReference(_params(), _muon)
    params = _params()
    sim = SimBackend(mode="random", seed=2)
    config = SwapConfig(backend=sim, swap_times=2, min_numel=128, packed=False, master_weights=True)
    optimizer = swap_optimizer(_muon(list(params)), config)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        for param, reference_param in zip(params, reference.params, strict=True):
            param.grad = torch.randn(param.shape, generator=generator).bfloat16()
            reference_param.grad = param.grad.clone()
        reference.step()
        optimizer.step()
        reference.assert_matches(optimizer, params, f"step {step}")
    swapped = [param for param in params if param.numel() >= 128]
    numel = sum(param.numel() for param in swapped)
    moved = sum(4 * param.numel() + remainder_nbytes(param.numel()) for param in swapped)
    assert optimizer.stats.h2d_bytes == optimizer.stats.d2h_bytes == moved
    assert moved / numel <= 6.25
