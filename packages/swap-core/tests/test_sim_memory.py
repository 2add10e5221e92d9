"""Device-byte accounting, poison, memory classes and the pinned-memory fallback of SimBackend."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable

import pytest
import torch

from swap_core.backends.host_memory import PAGE_BYTES
from swap_core.backends.protocol import DeviceBackend, Event
from swap_core.errors import PinnedMemoryWarning, SimRaceError
from swap_core.sim import MemoryKind, SimBackend

pytestmark = pytest.mark.sim_only  # tests of the simulator itself: skipped with --backend cuda|npu


def test_is_a_device_backend() -> None:
    sim = SimBackend()
    assert isinstance(sim, DeviceBackend)
    assert isinstance(sim.record_event(sim.new_stream()), Event)
    assert sim.name == "sim"
    assert sim.device == torch.device("cpu")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "eager"}, ValueError, "Invalid simulator mode: 'eager'"),
        ({"seed": 1.5}, TypeError, "Invalid simulator seed: 1.5"),
        ({"on_race": "ignore"}, ValueError, "Invalid on_race: 'ignore'"),
    ],
)
def test_constructor_validates_arguments(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        SimBackend(**kwargs)  # type: ignore[arg-type]


# -- accounting --------------------------------------------------------------------------------------------------------


def test_memory_allocated_counts_exactly_across_empty_release_restore_and_gc() -> None:
    sim = SimBackend()
    first = sim.empty((4, 8), torch.float32)  # 128 bytes
    second = sim.empty((16,), torch.float64)  # 128 bytes
    assert (sim.memory_allocated(), sim.max_memory_allocated()) == (256, 256)

    sim.release_storage(first)
    assert (sim.memory_allocated(), sim.max_memory_allocated()) == (128, 256)
    sim.release_storage(first)  # releasing twice frees nothing more
    assert sim.memory_allocated() == 128

    sim.reset_peak_memory_stats()
    assert sim.max_memory_allocated() == 128
    sim.restore_storage(first)
    assert (sim.memory_allocated(), sim.max_memory_allocated()) == (256, 256)
    sim.restore_storage(first)  # already allocated: nothing to do
    assert sim.memory_allocated() == 256

    tail = second[4:]  # a view keeps its base, and so the allocation, alive
    del second
    gc.collect()
    assert sim.memory_allocated() == 256
    del tail
    gc.collect()
    assert sim.memory_allocated() == 128

    sim.release_storage(first)
    del first
    gc.collect()
    assert (sim.memory_allocated(), sim.max_memory_allocated()) == (0, 256)


def test_adopted_tensors_count_only_what_restore_storage_allocates() -> None:
    sim = SimBackend()
    param = torch.nn.Parameter(torch.ones(10))  # 40 bytes allocated before the simulator saw it
    sim.adopt(param)
    assert sim.memory_allocated() == 0
    sim.release_storage(param)
    assert sim.memory_allocated() == 0
    sim.restore_storage(param)
    assert (sim.memory_allocated(), sim.max_memory_allocated()) == (40, 40)
    del param
    gc.collect()
    assert sim.memory_allocated() == 0


def test_host_memory_is_not_device_memory() -> None:
    sim = SimBackend()
    host = sim.empty_host(1000, torch.float32)
    assert sim.memory_allocated() == 0
    assert not sim.owns(host)
    assert sim.memory_kind(host) is MemoryKind.HOST
    with pytest.raises(ValueError, match="host memory from empty_host"):
        sim.release_storage(host)
    with pytest.raises(ValueError, match="Cannot adopt host memory"):
        sim.adopt(host)


def test_pinned_host_bytes_and_their_peak_follow_buffers_exactly() -> None:
    sim = SimBackend(mode="sync")
    first = sim.empty_host(1000, torch.float32)  # 4000 bytes: one page exact (4 KiB, 64 KiB on some aarch64)
    second = sim.empty_host(5000, torch.float32, mode="caching")  # 20000 bytes: 32768 caching
    view = second[10:20]
    assert sim.host_pinned_bytes() == sim.max_host_pinned_bytes() == PAGE_BYTES + 32768
    del first
    gc.collect()
    assert sim.host_pinned_bytes() == 32768 and sim.max_host_pinned_bytes() == PAGE_BYTES + 32768
    sim.reset_peak_memory_stats()
    assert sim.max_host_pinned_bytes() == 32768
    del second
    gc.collect()
    assert sim.host_pinned_bytes() == 32768, "a view keeps its buffer pinned"
    del view
    gc.collect()
    assert sim.host_pinned_bytes() == 32768, "torch's caching pinned allocator keeps the freed block pinned"
    sim.empty_host_cache()
    assert sim.host_pinned_bytes() == 0 and sim.max_host_pinned_bytes() == 32768


def test_owns_every_cpu_tensor_but_host_memory() -> None:
    sim = SimBackend()
    plain = torch.zeros(3)
    staging = sim.empty((3,), torch.float32)
    assert sim.owns(plain) and sim.memory_kind(plain) is None
    assert sim.owns(staging) and sim.memory_kind(staging) is MemoryKind.DEVICE
    assert sim.owns(staging[1:])
    assert not sim.owns(torch.zeros(3, device="meta"))


def test_restore_storage_needs_a_whole_dense_tensor() -> None:
    sim = SimBackend()
    staging = sim.empty((4, 4), torch.float32)
    with pytest.raises(ValueError, match=r"dense tensor at storage offset 0, got shape \(4, 2\), stride \(4, 2\)"):
        sim.restore_storage(staging[:, ::2])
    with pytest.raises(ValueError, match="offset 4"):
        sim.restore_storage(staging[1])
    with pytest.raises(ValueError, match="holds 64 bytes and the tensor needs 16"):
        sim.restore_storage(staging.view(-1)[:4])


def _allocate_until_address_reused(allocate: Callable[[], torch.Tensor], key: int) -> torch.Tensor:
    """Allocate until a storage lands at ``key`` (the CPU allocator reuses freed addresses within a few tries).

    Callers collect garbage before they make the storage whose address they wait for: garbage of earlier tests
    collected between its free and these tries would put chunks of its size in front of it in the allocator's
    free lists (it failed now and then under pytest-xdist on a loaded machine).
    """
    kept = []
    for _ in range(200):
        tensor = allocate()
        if tensor.untyped_storage()._cdata == key:
            return tensor
        kept.append(tensor)  # keep misses alive so the next try gets another address
    pytest.fail("the allocator never reused the freed storage address")


def test_a_collected_host_buffer_does_not_classify_its_address_successor() -> None:
    gc.collect()  # earlier tests' garbage goes now, not between this free and its successor (see above)
    sim = SimBackend()
    host = sim.empty_host(4, torch.float32)
    key = host.untyped_storage()._cdata
    del host
    gc.collect()
    successor = _allocate_until_address_reused(lambda: torch.empty(4), key)
    assert sim.memory_kind(successor) is None
    assert sim.owns(successor)


def test_a_new_allocation_at_a_reused_address_starts_without_history() -> None:
    # Without the caching allocator: CPU memory reused by torch is an unrelated block. (With it, the same
    # program reuses the freed block itself, a premature reuse: test_sim_caching_allocator.py.)
    gc.collect()  # earlier tests' garbage goes now, not between this free and its successor (see above)
    sim = SimBackend(mode="sync", caching_allocator=False)
    compute, d2h = sim.compute_stream(), sim.new_stream()
    host = sim.empty_host(4, torch.float32)
    staging = sim.empty((4,), torch.float32)
    sim.wait_event(d2h, sim.record_event(compute))
    sim.copy(host, staging, stream=d2h)  # nobody waits for this read of `staging`
    key = staging.untyped_storage()._cdata
    del staging
    gc.collect()
    successor = _allocate_until_address_reused(lambda: sim.empty((4,), torch.float32), key)
    with sim.compute_scope():
        successor.zero_()  # would race with the stale D2H read if the history had survived
    assert sim.races == []


# -- poison ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fresh_memory_is_poisoned_as_nan(dtype: torch.dtype) -> None:
    sim = SimBackend()
    assert torch.isnan(sim.empty((5,), dtype)).all()
    assert torch.isnan(sim.empty_host(5, dtype)).all()


def test_integer_poison_is_all_ones_bytes() -> None:
    sim = SimBackend()
    assert torch.equal(sim.empty((3,), torch.int64), torch.full((3,), -1, dtype=torch.int64))


def test_poison_off_leaves_memory_alone() -> None:
    sim = SimBackend(poison=False)
    staging = sim.empty((64,), torch.float32)
    staging.zero_()
    sim.release_storage(staging)
    sim.restore_storage(staging)
    # torch's allocator hands back whatever was there: the point is only that the simulator wrote nothing
    assert staging.untyped_storage().nbytes() == 256


def test_restored_memory_is_poisoned_again() -> None:
    sim = SimBackend()
    staging = sim.empty((4,), torch.float32)
    staging.fill_(1.0)
    sim.release_storage(staging)
    sim.restore_storage(staging)
    assert torch.isnan(staging).all()


# -- pinned memory fallback -----------------------------------------------------------------------------------------


def test_pin_failure_warns_once() -> None:
    sim = SimBackend(pinned_memory=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = sim.empty_host(4, torch.float32)
        sim.empty_host(4, torch.float32)
    assert [warning.category for warning in caught] == [PinnedMemoryWarning]
    assert issubclass(PinnedMemoryWarning, UserWarning)
    assert "Pinned host memory is unavailable" in str(caught[0].message)
    assert "copies become synchronous" in str(caught[0].message)
    assert caught[0].filename == __file__
    assert sim.memory_kind(first) is MemoryKind.PAGEABLE_HOST


def test_pageable_copies_run_synchronously_and_order_the_host() -> None:
    sim = SimBackend(mode="lazy", pinned_memory=False)
    compute, h2d, d2h = sim.compute_stream(), sim.new_stream(), sim.new_stream()
    with pytest.warns(PinnedMemoryWarning):
        host = sim.empty_host(4, torch.float32)
    host.copy_(torch.arange(4.0))
    staging = sim.empty((4,), torch.float32)
    sim.wait_event(h2d, sim.record_event(compute))
    sim.copy(staging, host, stream=h2d)
    assert sim.pending_ops() == 0
    sim.wait_event(compute, sim.record_event(h2d))
    with sim.compute_scope():
        staging.add_(10)
    sim.wait_event(d2h, sim.record_event(compute))
    sim.copy(host, staging, stream=d2h)
    assert sim.pending_ops() == 0
    with sim.compute_scope():  # no event synchronize needed: the copy finished before copy() returned
        assert torch.equal(host.clone(), torch.arange(4.0) + 10)
    assert sim.races == []


def test_pinned_copies_stay_queued_in_lazy_mode() -> None:
    sim = SimBackend(mode="lazy")
    compute, h2d = sim.compute_stream(), sim.new_stream()
    host = sim.empty_host(4, torch.float32)
    host.copy_(torch.arange(4.0))
    staging = sim.empty((4,), torch.float32)
    sim.wait_event(h2d, sim.record_event(compute))
    sim.copy(staging, host, stream=h2d)
    event = sim.record_event(h2d)
    assert sim.pending_ops() == 1
    assert not event.query()
    assert torch.isnan(staging).all()
    sim.wait_event(compute, event)
    assert event.query()
    assert sim.pending_ops() == 0
    assert torch.equal(staging, torch.arange(4.0))


def test_sync_mode_runs_copies_at_once_but_still_checks_ordering() -> None:
    sim = SimBackend(mode="sync")
    compute, h2d = sim.compute_stream(), sim.new_stream()
    host = sim.empty_host(4, torch.float32)
    host.copy_(torch.arange(4.0))
    staging = sim.empty((4,), torch.float32)
    sim.wait_event(h2d, sim.record_event(compute))
    sim.copy(staging, host, stream=h2d)
    assert sim.pending_ops() == 0
    assert torch.equal(staging, torch.arange(4.0))
    with sim.compute_scope(), pytest.raises(SimRaceError):
        staging.add_(1)  # the value is there, yet no wait ordered the compute stream after the copy


def test_storage_spans_find_a_tensor_by_its_bytes_not_by_its_storage() -> None:
    import ctypes

    from swap_core.backends.storage_spans import StorageSpans

    buffer, other = torch.zeros(100), torch.zeros(10)
    spans = StorageSpans([buffer[10:20]])  # a view adds its whole storage
    assert buffer[90:] in spans and buffer[:1] in spans
    assert other not in spans and torch.zeros(0) not in spans and "buffer" not in spans
    view = buffer[40:50]
    raw = (ctypes.c_char * 40).from_address(view.data_ptr())
    alias = torch.frombuffer(raw, dtype=torch.float32)  # another storage over the same bytes
    assert alias.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    assert alias in spans
    assert other[9:] in StorageSpans([other, buffer[:5]])


def test_a_stream_ordered_release_frees_behind_the_copy_still_reading() -> None:
    """release_storage(t, in_use_on=stream): uncounted at once, freed when the stream's queue reaches it (the
    pending copy still reads the right bytes), and a restore is ordered after it: no race, no stale read."""
    sim = SimBackend(mode="lazy")
    device = sim.empty((1024,), torch.float32)
    with sim.compute_scope():
        device.fill_(3.0)
    host = sim.empty_host(1024, torch.float32)
    d2h = sim.new_stream()
    sim.wait_event(d2h, sim.record_event(sim.compute_stream()))
    sim.copy(host, device, stream=d2h)  # queued: lazy mode runs it only when forced
    sim.release_storage(device, in_use_on=d2h)
    assert sim.memory_allocated() == 0, "the bytes leave the accounting at once, as an allocator's count does"
    assert device.untyped_storage().nbytes() == 4096, "not freed before the copy that reads it ran"
    sim.restore_storage(device)  # the allocator hands the block back only after the stream freed it
    assert sim.memory_allocated() == 4096
    with sim.compute_scope():
        device.fill_(5.0)
    sim.synchronize()
    assert torch.equal(host, torch.full((1024,), 3.0)), "the copy read the bytes before they were reused"
    assert not sim.races, sim.races
