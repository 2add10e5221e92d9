"""``SwapConfig(step="in_backward")`` under FSDP2 on 2 gloo ranks: FSDP2 runs the post-accumulate-grad hooks of the
sharded parameters after their reduce-scatter, every batch updates inside the backward from the second step on,
and the result is bitwise the plain FSDP2 optimizer stepping after it, with gradient accumulation too; the same
under HSDP on 4 ranks (2 replicas of 2 shards). With ``clip_grad_norm_`` between backward and step (a norm
all-reduced across the shards) and under DDP (which all-reduces each gradient after its hook ran), the step takes
back what the backward updated and is still bitwise the plain loop."""

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

    mesh = init_device_mesh("cpu", (world_size,))
    options = ({"packed": True}, {"packed": False}, {"packed": True, "free_gradients": True})
    _check_parity(mesh, rank, options=options)
    _check_clipped_parity(mesh, rank)


def _in_backward_under_hsdp(rank: int, world_size: int) -> None:
    """HSDP: 2 replicas of 2 shards; the hooks run after the reduce-scatter and the all-reduce across replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    _check_parity(mesh, rank, options=({"packed": True},))
    _check_clipped_parity(mesh, rank)


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


def _check_clipped_parity(mesh: object, rank: int) -> None:
    """``clip_grad_norm_`` over the sharded gradients (its norm all-reduced across the mesh) between backward and
    step, binding on odd steps only: those take back the 3 batches the backward updated and redo them with the
    clipped gradients, the others commit; bitwise the plain FSDP2 loop. (``torch._foreach_mul_`` on a DTensor moves
    no version counter: the edit is told by the gradients' bits.)"""
    plain_model, model = fsdp2_linears(mesh, WIDTH), fsdp2_linears(mesh, WIDTH)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    sim = SimBackend(mode="random", seed=rank)
    config = SwapConfig(backend=sim, swap_times=3, min_numel=16, step="in_backward")
    swapped = swap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    for step in range(STEPS):
        max_norm = 0.05 if step % 2 else 100.0
        _train_step(plain, plain_model, swapped, model, step, rank, max_norm=max_norm)
        where = f"rank {rank}, clipped to {max_norm}, step {step}"
        stats = swapped.stats
        taken_back = 3 if step % 2 else 0
        assert stats.batches_taken_back == taken_back, (where, stats)
        assert stats.batches_in_backward == (3 - taken_back if step > 0 else 0), (where, stats)
        for index, (expected, actual) in enumerate(zip(plain_model.parameters(), model.parameters(), strict=True)):
            assert_bitwise_equal(expected, actual, f"{where}, parameter {index}")
    assert_state_dicts_equal(plain.state_dict(), swapped.state_dict(), f"rank {rank}: clipped optimizer states")
    assert not sim.races, sim.races
    dist.barrier()


def _train_step(
    plain: torch.optim.Optimizer,
    plain_model: torch.nn.Module,
    swapped: SwapOptimizer,
    model: torch.nn.Module,
    step: int,
    rank: int,
    *,
    max_norm: float | None = None,
) -> bool:
    """Odd steps accumulate two micro-batches (the first inside ``accumulating()``), even steps take one; the
    gradients clipped to ``max_norm`` before each step when given; whether every gradient was freed inside the last
    backward (``free_gradients=True``)."""
    micro_batches = MICRO_BATCHES if step % 2 else 1
    for micro_batch in range(micro_batches):
        _backward(plain_model, step, micro_batch, rank)
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), max_norm)
    plain.step()
    plain.zero_grad(set_to_none=True)
    with swapped.accumulating():
        for micro_batch in range(micro_batches - 1):
            _backward(model, step, micro_batch, rank)
    _backward(model, step, micro_batches - 1, rank)
    freed = all(param.grad is None for param in model.parameters())
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    swapped.step()
    swapped.zero_grad(set_to_none=True)
    return freed


def test_fsdp2_hooks_update_every_batch_inside_the_backward_bitwise_the_plain_optimizer() -> None:
    run_distributed(_in_backward_under_fsdp2, 2)


def test_hsdp_hooks_update_every_batch_inside_the_backward_bitwise_the_plain_optimizer() -> None:
    run_distributed(_in_backward_under_hsdp, 4)


def _ddp_steps_as_the_plain_loop(rank: int, world_size: int) -> None:
    """DDP all-reduces each gradient after its post-accumulate-grad hook ran, so what a batch updated inside the
    backward used the rank's own gradient: ``step()`` sees the averaged gradients, takes every batch back and steps
    again, bitwise plain DDP with its optimizer. Then, without provisional updates, the same is refused."""
    from torch.nn.parallel import DistributedDataParallel

    plain_model, model = DistributedDataParallel(_plain_linears()), DistributedDataParallel(_plain_linears())
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    sim = SimBackend(mode="random", seed=rank)
    config = SwapConfig(backend=sim, swap_times=2, min_numel=16, step="in_backward")
    swapped = swap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    for step in range(STEPS):
        for this_model, this_opt in ((plain_model, plain), (model, swapped)):
            _backward(this_model, step, 0, rank)
            this_opt.step()
            this_opt.zero_grad(set_to_none=True)
        where = f"rank {rank}, step {step}"
        assert swapped.stats.batches_taken_back == (2 if step > 0 else 0), (where, swapped.stats)
        for index, (expected, actual) in enumerate(zip(plain_model.parameters(), model.parameters(), strict=True)):
            assert_bitwise_equal(expected, actual, f"{where}, parameter {index}")
    assert_state_dicts_equal(plain.state_dict(), swapped.state_dict(), f"rank {rank}: DDP optimizer states")
    assert not sim.races, sim.races
    _ddp_is_refused_before_anything_changes(rank, world_size)


def _ddp_is_refused_before_anything_changes(rank: int, world_size: int) -> None:
    """Without provisional updates: DDP all-reduces each gradient after its post-accumulate-grad hook ran, so batches
    updated from that hook would use the rank's own gradient. The first step, after the backward, sees the gradients
    rewritten and refuses."""
    from torch.nn.parallel import DistributedDataParallel

    model = _plain_linears()
    before = [param.detach().clone() for param in model.parameters()]
    ddp = DistributedDataParallel(model)
    config = SwapConfig(
        backend=SimBackend(mode="lazy"), swap_times=2, min_numel=16, step="in_backward", provisional_updates=False
    )
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


def test_ddp_steps_as_the_plain_loop_and_without_provisional_updates_is_refused() -> None:
    run_distributed(_ddp_steps_as_the_plain_loop, 2)
