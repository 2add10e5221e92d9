"""``SwapConfig(step="in_backward")`` under FSDP2 on 2 gloo ranks: FSDP2 runs the post-accumulate-grad hooks of the
sharded parameters after their reduce-scatter, every batch updates inside the backward from the second step on,
and the result is bitwise the plain FSDP2 optimizer stepping after it, with gradient accumulation too; the same
under HSDP on 4 ranks (2 replicas of 2 shards)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.errors import SwapStateError
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_core.testing.distributed import fsdp2_linears, run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]

WIDTH = 16
STEPS = 4
MICRO_BATCHES = 2


def _backward(model: torch.nn.Module, step: int, micro_batch: int, rank: int) -> None:
    seed = 1000 * step + 10 * micro_batch + rank
    model(torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(seed))).square().mean().backward()


def _in_backward_under_fsdp2(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    options = ({"packed": True}, {"packed": False}, {"packed": True, "free_gradients": True})
    _check_parity(init_device_mesh("cpu", (world_size,)), rank, options=options)


def _in_backward_under_hsdp(rank: int, world_size: int) -> None:
    """HSDP: 2 replicas of 2 shards; the hooks run after the reduce-scatter and the all-reduce across replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    _check_parity(mesh, rank, options=({"packed": True},))


def _check_parity(mesh: object, rank: int, *, options: tuple[dict[str, bool], ...]) -> None:
    for option in options:
        plain_model, model = fsdp2_linears(mesh, WIDTH), fsdp2_linears(mesh, WIDTH)
        plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
        sim = SimBackend(mode="random", seed=rank)
        config = SwapConfig(backend=sim, swap_times=3, min_numel=16, step="in_backward").replace(**option)
        swapped = swap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
        for step in range(STEPS):
            freed = _train_step(plain, plain_model, swapped, model, step, rank)
            where = f"rank {rank}, {option}, step {step}"
            assert freed == (bool(option.get("free_gradients")) and step > 0), where
            stats = swapped.stats
            assert stats.batches == 3 and stats.batches_in_backward == (3 if step > 0 else 0), (where, stats)
            for index, (expected, actual) in enumerate(zip(plain_model.parameters(), model.parameters(), strict=True)):
                assert_bitwise_equal(expected, actual, f"{where}, parameter {index}")
        assert_state_dicts_equal(plain.state_dict(), swapped.state_dict(), f"rank {rank}: optimizer states")
        assert not sim.races, sim.races
    dist.barrier()


def _train_step(
    plain: torch.optim.Optimizer,
    plain_model: torch.nn.Module,
    swapped: SwapOptimizer,
    model: torch.nn.Module,
    step: int,
    rank: int,
) -> bool:
    """Odd steps accumulate two micro-batches (the first inside ``accumulating()``), even steps take one; whether
    every gradient was freed inside the last backward (``free_gradients=True``)."""
    micro_batches = MICRO_BATCHES if step % 2 else 1
    for micro_batch in range(micro_batches):
        _backward(plain_model, step, micro_batch, rank)
    plain.step()
    plain.zero_grad(set_to_none=True)
    with swapped.accumulating():
        for micro_batch in range(micro_batches - 1):
            _backward(model, step, micro_batch, rank)
    _backward(model, step, micro_batches - 1, rank)
    freed = all(param.grad is None for param in model.parameters())
    swapped.step()
    swapped.zero_grad(set_to_none=True)
    return freed


def test_fsdp2_hooks_update_every_batch_inside_the_backward_bitwise_the_plain_optimizer() -> None:
    run_distributed(_in_backward_under_fsdp2, 2)


def test_hsdp_hooks_update_every_batch_inside_the_backward_bitwise_the_plain_optimizer() -> None:
    run_distributed(_in_backward_under_hsdp, 4)


def _ddp_is_refused_before_anything_changes(rank: int, world_size: int) -> None:
    """DDP all-reduces each gradient after its post-accumulate-grad hook ran: batches updated from that hook would
    use the rank's own gradient. The first step, after the backward, sees the gradients rewritten and refuses."""
    from torch.nn.parallel import DistributedDataParallel

    model = _plain_linears()
    before = [param.detach().clone() for param in model.parameters()]
    ddp = DistributedDataParallel(model)
    config = SwapConfig(backend=SimBackend(mode="lazy"), swap_times=2, min_numel=16, step="in_backward")
    optimizer = swap_optimizer(torch.optim.AdamW(ddp.parameters(), lr=1e-2), config)
    _backward(ddp, 0, 0, rank)
    with pytest.raises(SwapStateError, match=r"DDP's all-reduce"):
        optimizer.step()
    for index, (expected, actual) in enumerate(zip(before, model.parameters(), strict=True)):
        assert_bitwise_equal(expected, actual, f"rank {rank}: parameter {index} after the refusal")
    assert not optimizer.state
    dist.barrier()


def _plain_linears() -> torch.nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)))


def test_ddp_is_refused_at_the_first_step_before_anything_changes() -> None:
    run_distributed(_ddp_is_refused_before_anything_changes, 2)
