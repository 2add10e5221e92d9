"""The simulator's caching allocator: freed blocks are kept and reused, stream-ordered, and a premature reuse is a race.

See swap_core.backends.sim.caching_allocator for the contract these tests hold it to.
"""

from __future__ import annotations

import gc

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.backends.protocol import DeviceBackend, Stream
from swap_core.errors import SimUseAfterFreeError
from swap_core.sim import LinkModel, SimBackend, modeled_iterations

pytestmark = pytest.mark.sim_only  # tests of the simulator itself: skipped with --backend cuda|npu

LINK = LinkModel(h2d_gbps=20.0, d2h_gbps=10.0, device_gbps=1000.0, launch_us=5.0)


def test_memory_reserved_counts_allocated_plus_cached_bytes_exactly() -> None:
    sim = SimBackend()
    first = sim.empty((256,), torch.float32)  # 1,024 bytes
    second = sim.empty((64,), torch.int64)  # 512 bytes
    assert (sim.memory_allocated(), sim.memory_reserved()) == (1536, 1536)
    sim.release_storage(first)
    assert (sim.memory_allocated(), sim.memory_reserved()) == (512, 1536), "a freed block stays reserved"
    del second
    gc.collect()
    assert (sim.memory_allocated(), sim.memory_reserved()) == (0, 1536), "so does a collected tensor's block"
    again = sim.empty((128,), torch.float64)  # 1,024 bytes of another dtype: reuses the first block
    assert (sim.memory_allocated(), sim.memory_reserved()) == (1024, 1536)
    assert sim.max_memory_reserved() == 1536
    sim.restore_storage(first)  # no cached 1,024-byte block is left: new memory is reserved
    assert (sim.memory_allocated(), sim.memory_reserved()) == (2048, 2560)
    assert sim.max_memory_reserved() == 2560 and sim.max_memory_allocated() == 2048
    del again


def test_empty_cache_gives_back_every_cached_block() -> None:
    sim = SimBackend(check_races=False)
    kept = sim.empty((100,), torch.float32)
    released = sim.empty((300,), torch.float32)
    sim.release_storage(released)
    assert sim.memory_reserved() == 1600
    sim.empty_cache()
    assert (sim.memory_allocated(), sim.memory_reserved()) == (400, 400)
    assert released.untyped_storage().nbytes() == 0, "the cached bytes were unmapped"
    sim.restore_storage(released)  # still restorable: new memory
    assert (sim.memory_allocated(), sim.memory_reserved()) == (1600, 1600)
    sim.reset_peak_memory_stats()
    assert sim.max_memory_reserved() == 1600
    del kept


def test_caching_off_reserves_only_what_is_allocated() -> None:
    sim = SimBackend(caching_allocator=False)
    staging = sim.empty((256,), torch.float32)
    sim.release_storage(staging)
    assert (sim.memory_allocated(), sim.memory_reserved(), sim.max_memory_reserved()) == (0, 0, 1024)


@pytest.mark.parametrize("check_races", [True, False])
def test_reserved_stays_flat_over_swapped_adamw_steps_while_allocated_returns(check_races: bool) -> None:
    sim = SimBackend(mode="lazy", check_races=check_races)
    params = [torch.randn(64, 64) for _ in range(8)]
    optimizer = swap_optimizer(torch.optim.AdamW(params, lr=1e-3), SwapConfig(backend=sim, swap_times=4))
    readings = []
    for step in range(4):
        for param in params:
            param.grad = torch.full_like(param, 0.01 * (step + 1))
        optimizer.step()
        optimizer.synchronize()
        readings.append((sim.memory_allocated(), sim.memory_reserved()))
    assert readings[0][1] == 2 * 2 * 2 * 64 * 64 * 4, "two staging arenas of two batch params' two states"
    assert readings[1:] == readings[:-1], readings
    assert readings[0][0] == 0, "between steps nothing is allocated: the arenas' blocks are cached"
    assert sim.max_memory_reserved() == readings[0][1]
    assert optimizer.stats.peak_state_device_bytes == readings[0][1]


def _pending_d2h(sim: SimBackend, numel: int = 1024) -> tuple[torch.Tensor, torch.Tensor, Stream]:
    """A device tensor of 3.0s whose copy to host is queued on a copy stream (lazy: not run yet)."""
    device = sim.empty((numel,), torch.float32)
    with sim.compute_scope():
        device.fill_(3.0)
    host = sim.empty_host(numel, torch.float32)
    d2h = sim.new_stream()
    sim.wait_event(d2h, sim.record_event(sim.compute_stream()))
    sim.copy(host, device, stream=d2h)
    return device, host, d2h


def test_a_block_still_in_use_on_a_stream_is_passed_by_without_blocking_the_host() -> None:
    sim = SimBackend(mode="lazy")
    device, host, d2h = _pending_d2h(sim)
    sim.release_storage(device, in_use_on=d2h)
    assert sim.pending_ops() == 2, "the copy and the release right behind it are queued"
    fresh = sim.empty((16, 64), torch.float32)  # the same 4,096 bytes, but the block's copy has not run
    assert sim.memory_reserved() == 8192, "new memory was reserved instead of waiting for the stream"
    assert sim.pending_ops() == 2, "nothing was forced to run"
    with sim.compute_scope():
        fresh.fill_(5.0)
    sim.synchronize()
    assert torch.equal(host, torch.full((1024,), 3.0)), "the copy read its own bytes"
    del fresh
    reused = sim.empty((1024,), torch.float32)  # the copy and the release have run: the oldest block is free
    assert sim.memory_reserved() == 8192, "a block whose release completed is reused"
    with sim.compute_scope():
        reused.fill_(1.0)
    assert not sim.races, sim.races


def test_a_restore_while_its_own_release_is_pending_takes_new_bytes_and_the_copy_keeps_the_old() -> None:
    sim = SimBackend(mode="lazy")
    device, host, d2h = _pending_d2h(sim)
    sim.release_storage(device, in_use_on=d2h)
    sim.restore_storage(device)
    assert sim.memory_reserved() == 8192 and sim.memory_allocated() == 4096
    with sim.compute_scope():
        device.fill_(7.0)  # the next step writes its new bytes before the old copy ran
    sim.synchronize()
    assert torch.equal(host, torch.full((1024,), 3.0)), "the queued copy read the bytes it was issued for"
    assert not sim.races, sim.races


def test_a_block_is_reused_only_once_its_release_passed_on_the_virtual_clock() -> None:
    sim = SimBackend(mode="lazy", timing=LINK)
    device, _, d2h = _pending_d2h(sim, numel=2**20)  # 4 MiB over 10 GB/s: 419 us
    sim.release_storage(device, in_use_on=d2h)
    done = sim.record_event(d2h)
    sim.wait_event(sim.compute_stream(), done)  # the queue runs, but the host has not seen the copy's end
    times = sim.modeled_times()
    assert times is not None and times.host < times.transfers
    sim.empty((2**20,), torch.float32)
    assert sim.memory_reserved() == 2 * 2**22, "an event query at host time would still find the copy running"
    sim.synchronize()
    sim.empty((2**20,), torch.float32)
    assert sim.memory_reserved() == 2 * 2**22, "once the host is past the release, the block is reused"
    after = sim.modeled_times()
    assert after is not None and after.compute >= times.transfers


def test_blocks_are_pooled_by_stream() -> None:
    sim = SimBackend(mode="lazy")
    side = sim.new_stream()
    staging = sim.empty((1024,), torch.float32)
    sim.release_storage(staging)
    with sim.stream(side):
        other = sim.empty((1024,), torch.float32)
    assert sim.memory_reserved() == 8192, "the compute stream's cached block is not handed to another stream"
    sim.release_storage(other)
    with sim.stream(side):
        again = sim.empty((1024,), torch.float32)
    assert sim.memory_reserved() == 8192, "the side stream reuses its own block"
    del again


def test_a_fresh_block_does_not_wait_for_a_copy_stream() -> None:
    sim = SimBackend(mode="lazy", timing=LINK)
    device, _, d2h = _pending_d2h(sim)
    sim.release_storage(device, in_use_on=d2h)
    before = sim.modeled_times()
    sim.empty((1023,), torch.float32)  # another size: new memory, no ordering
    after = sim.modeled_times()
    assert before is not None and after is not None
    assert after.compute == before.compute and sim.pending_ops() == 2
    assert sim.memory_reserved() == 4096 + 4092


@pytest.mark.parametrize(
    ("mode", "seed"),
    [("lazy", 0), ("random", 0), ("random", 5)],  # random seed 0 runs the copy before the free, 5 leaves it queued
)
def test_premature_reuse_is_reported_by_the_race_checker(mode: str, seed: int) -> None:
    """A block freed on the compute stream (no in_use_on) while a copy still reads it, then reused: the race."""
    sim = SimBackend(mode=mode, seed=seed, on_race="record")  # type: ignore[arg-type]
    device, _, _ = _pending_d2h(sim)
    sim.release_storage(device)  # missing: in_use_on=d2h, or a wait for the copy
    sim.races.clear()  # the free itself is reported too; the point here is the reuse
    sim.empty((1024,), torch.float32)  # its allocation write is the reuse
    assert sim.memory_reserved() == 4096, "the freed block was handed to the new allocation"
    assert sim.races, "the premature reuse went unreported"
    assert "read by stream1 (copy d2h)" in sim.races[0]
    assert "write by compute (empty (reuses a cached block))" in sim.races[0]
    if sim.pending_ops():  # lazy: the late copy is still queued and finds its storage gone
        with pytest.raises(SimUseAfterFreeError):
            sim.synchronize()


@pytest.mark.parametrize("seed", range(12))
def test_premature_reuse_is_caught_under_every_random_schedule(seed: int) -> None:
    """Whenever the late copy runs: before the reuse is issued it finds its storage freed, else the reuse races."""
    sim = SimBackend(mode="random", seed=seed, on_race="record")
    device, _, _ = _pending_d2h(sim)
    try:
        sim.release_storage(device)
        sim.races.clear()
        sim.empty((1024,), torch.float32)
    except SimUseAfterFreeError as error:
        assert "d2h copy ran after the storage of its source was released" in str(error)
    else:
        assert len(sim.races) == 1 and "empty (reuses a cached block)" in sim.races[0], sim.races


def test_premature_reuse_of_a_collected_tensors_block_is_a_race() -> None:
    """A tensor dropped while a copy stream still reads it (no record_stream): its block's history goes along."""
    sim = SimBackend(mode="sync", on_race="record")
    host = sim.empty_host(256, torch.float32)
    d2h = sim.new_stream()
    staging = sim.empty((256,), torch.float32)
    sim.wait_event(d2h, sim.record_event(sim.compute_stream()))
    sim.copy(host, staging, stream=d2h)  # nobody waits for this read
    del staging
    gc.collect()
    sim.empty((16, 16), torch.float32)
    assert len(sim.races) == 1 and "empty (reuses a cached block)" in sim.races[0], sim.races


def test_an_ordered_reuse_of_a_collected_tensors_block_is_no_race() -> None:
    sim = SimBackend(mode="lazy")
    host = sim.empty_host(256, torch.float32)
    d2h = sim.new_stream()
    staging = sim.empty((256,), torch.float32)
    sim.wait_event(d2h, sim.record_event(sim.compute_stream()))
    sim.copy(host, staging, stream=d2h)
    sim.wait_event(sim.compute_stream(), sim.record_event(d2h))
    del staging
    gc.collect()
    sim.empty((256,), torch.float32)
    assert sim.memory_reserved() == 1024 and not sim.races


@pytest.mark.parametrize("check_races", [True, False])
def test_a_reused_block_is_poisoned_again(check_races: bool) -> None:
    sim = SimBackend(check_races=check_races)
    staging = sim.empty((64,), torch.float32)
    staging.fill_(1.0)
    sim.release_storage(staging)
    sim.restore_storage(staging)  # its own cached block
    assert torch.isnan(staging).all()
    staging.fill_(1.0)
    sim.release_storage(staging)
    successor = sim.empty((256,), torch.uint8)  # the same block, for another tensor and dtype
    assert sim.memory_reserved() == 256
    assert torch.equal(successor, torch.full((256,), 0xFF, dtype=torch.uint8))


def test_reuse_by_another_tensor_unmaps_the_released_storage_without_checks() -> None:
    sim = SimBackend(check_races=False)
    released = sim.empty((64,), torch.float32)
    sim.release_storage(released)
    assert released.untyped_storage().nbytes() == 256, "without checks a cached block stays mapped"
    successor = sim.empty((64,), torch.float32)  # takes that block
    assert successor.untyped_storage().nbytes() == 256
    assert released.untyped_storage().nbytes() == 0, "so the released tensor no longer maps it"
    sim.restore_storage(released)  # new memory
    assert (sim.memory_allocated(), sim.memory_reserved()) == (512, 512)


def test_memory_reserved_is_part_of_the_device_backend_protocol() -> None:
    backend: DeviceBackend = SimBackend()
    assert backend.memory_reserved() == 0


def test_a_restore_never_takes_another_released_storages_block() -> None:
    """Else each restore would unmap the next one's bytes, every step (a cascade of page faults without checks)."""
    sim = SimBackend(check_races=False)
    first = sim.empty((64,), torch.float32)
    sim.release_storage(first)
    second = sim.empty((64,), torch.float32)  # a new allocation takes the cached block, unmapping it from `first`
    sim.release_storage(second)
    mapped_at = second.untyped_storage().data_ptr()
    sim.restore_storage(first)  # its own block is gone; `second`'s stays with `second`
    assert second.untyped_storage().nbytes() == 256, "the restore unmapped another released storage"
    assert (sim.memory_allocated(), sim.memory_reserved()) == (256, 512)
    sim.restore_storage(second)
    assert second.untyped_storage().data_ptr() == mapped_at, "the restore took its own block back, still mapped"
    assert (sim.memory_allocated(), sim.memory_reserved()) == (512, 512)


def test_a_training_loops_reserved_staging_is_at_most_twice_the_peak() -> None:
    """The allocator never waits for the last copy-out of a step: the next step's staging takes new blocks while it
    runs. In a loop that reads its loss every iteration (the host then never runs more than a step ahead), the
    device holds at most two sets of staging: the step's arenas and the previous step's, still being copied out.
    What the step allocates at once stays the two arenas it always was."""
    sim = SimBackend(mode="lazy", check_races=False, poison=False, timing=LinkModel.preset("pcie5"))
    params = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(8)]
    optimizer = swap_optimizer(torch.optim.RMSprop(params), SwapConfig(backend=sim, swap_times=4))

    def step() -> None:
        for param in params:
            param.grad = torch.ones_like(param)
        optimizer.step()

    modeled_iterations(sim, step, forward_backward_seconds=1e-3, iterations=6, read_loss=True)
    staging = optimizer.stats.peak_state_device_bytes
    assert sim.max_memory_allocated() == staging
    assert staging < sim.max_memory_reserved() <= 2 * staging
