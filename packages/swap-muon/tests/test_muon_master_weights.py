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


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize(("mode", "seed"), MODES, ids=[f"{mode}{seed}" for mode, seed in MODES])
def test_muon_with_master_weights_is_bitwise_the_reference(mode: str, seed: int, packed: bool) -> None:
    reference = MasterReference(_params(), _muon)
    params = _params()
    sim = SimBackend(mode=mode, seed=seed)  # type: ignore[arg-type]
    config = SwapConfig(backend=sim, swap_times=2, min_numel=128, packed=packed, master_weights=True)
    optimizer = swap_optimizer(_muon(list(params)), config)
    for step in range(10):
        reference.set_grads(step, params)
        reference.step()
        optimizer.step()
        reference.assert_matches(optimizer, params, f"{mode}{seed} step {step}")
    assert not sim.races, sim.races
    state = optimizer.state[params[0]]
    assert state["momentum_buffer"].dtype == state[MASTER_KEY].dtype == torch.float32


def test_distributed_muon_with_master_weights_is_refused_before_anything_changes() -> None:
    """Owner-rank Muon (DTensor parameters) would gather the bf16 parameters, not their masters: refused, naming why."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from swap_core.errors import UnsupportedOptimizerError
    from swap_core.testing.distributed import initialized_process_group

    def run() -> None:
        mesh = init_device_mesh("cpu", (1,))
        params = [torch.nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])) for param in _params()]
        plain = _muon(list(params))
        config = SwapConfig(backend=SimBackend(), min_numel=128, master_weights=True)
        with pytest.raises(UnsupportedOptimizerError, match=r"through DistributedMuonAdapter: the owner rank gathers"):
            swap_optimizer(plain, config)
        assert not plain.state and not plain._optimizer_step_pre_hooks

    with initialized_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1):
        run()
