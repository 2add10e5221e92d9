"""Single-process Muon with SwapConfig(master_weights=True): bitwise torch's Muon over fp32 masters.

The reference is swap_core.testing.masters.MasterReference: ``torch.optim.Muon`` over fp32 leaf
copies of bf16 matrices, ``m.grad = p.grad.float()``, ``step()``, ``p.copy_(m)``. The momentum
and the master of each matrix are fp32 state, swapped together.
"""

from __future__ import annotations

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.master_weights import MASTER_KEY
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
                assert_bitwise_equal(master, state[MASTER_KEY].full_tensor(), f"{where}: master")
                momentum = reference.optimizer.state[master]["momentum_buffer"]
                assert_bitwise_equal(momentum, state["momentum_buffer"], f"{where}: momentum (fp32, whole)")

    with initialized_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1):
        run()
