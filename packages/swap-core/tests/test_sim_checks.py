"""Per-op checks inside SimBackend.compute_scope(): freed storage, host/device mixing, copy validation."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from swap_core.backends.sim.checks import op_access_pattern
from swap_core.errors import (
    SimMixedDeviceError,
    SimPageableCopyError,
    SimRaceError,
    SimUseAfterFreeError,
)
from swap_core.sim import MemoryKind, SimBackend

pytestmark = pytest.mark.sim_only  # tests of the simulator itself: skipped with --backend cuda|npu

aten = torch.ops.aten


def _released_staging(sim: SimBackend) -> torch.Tensor:
    staging = sim.empty((4, 4), torch.float32)
    sim.release_storage(staging)
    assert staging.untyped_storage().nbytes() == 0
    return staging


# -- use after free ----------------------------------------------------------------------------------------------------


def test_reading_released_storage_raises_instead_of_segfaulting() -> None:
    sim = SimBackend()
    staging = _released_staging(sim)
    with sim.compute_scope(), pytest.raises(SimUseAfterFreeError) as caught:
        staging.sum()
    message = str(caught.value)
    assert "aten::sum" in message
    assert "(4, 4) torch.float32" in message
    assert "released with release_storage; call restore_storage" in message


def test_writing_released_storage_through_a_foreach_list_raises() -> None:
    sim = SimBackend()
    live = sim.empty((3,), torch.float32)
    staging = _released_staging(sim)
    with sim.compute_scope(), pytest.raises(SimUseAfterFreeError, match=r"aten::_foreach_add_\.Scalar"):
        torch._foreach_add_([live, staging], 1.0)


def test_metadata_ops_on_released_storage_pass_until_data_is_touched() -> None:
    sim = SimBackend()
    staging = _released_staging(sim)
    with sim.compute_scope():
        flat = staging.view(-1)
        alias = staging.detach()
        like = torch.zeros_like(staging)
        assert flat.shape == (16,) and alias.shape == (4, 4)
        assert torch.equal(like, torch.zeros(4, 4))
        with pytest.raises(SimUseAfterFreeError):
            flat.add_(1)


def test_restored_storage_is_usable_and_poisoned() -> None:
    sim = SimBackend()
    staging = _released_staging(sim)
    sim.restore_storage(staging)
    with sim.compute_scope():
        assert torch.isnan(staging).all()
        staging.fill_(2.0)
        assert staging.sum().item() == 32.0


def test_releasing_a_plain_tensor_makes_it_checked_device_memory() -> None:
    sim = SimBackend()
    state = torch.ones(8)
    sim.release_storage(state)
    with sim.compute_scope(), pytest.raises(SimUseAfterFreeError, match="restore_storage"):
        state.mul_(2)


# -- host/device mixing ------------------------------------------------------------------------------------------------


def test_op_mixing_host_and_device_memory_raises_naming_the_op() -> None:
    sim = SimBackend()
    staging = sim.empty((8,), torch.float32)
    host = sim.empty_host(8, torch.float32)
    with sim.compute_scope(), pytest.raises(SimMixedDeviceError) as caught:
        staging.add_(host)
    message = str(caught.value)
    assert "aten::add_.Tensor" in message
    assert "host memory (a (8,) torch.float32 tensor)" in message
    assert "SimBackend.copy" in message


def test_tensor_copy_between_host_and_device_is_mixing() -> None:
    sim = SimBackend()
    staging = sim.empty((8,), torch.float32)
    host = sim.empty_host(8, torch.float32)
    with sim.compute_scope(), pytest.raises(SimMixedDeviceError, match="aten::copy_"):
        staging.copy_(host)


def test_plain_tensors_mix_with_either_side() -> None:
    sim = SimBackend(poison=False)
    staging = sim.empty((8,), torch.float32).zero_()
    host = sim.empty_host(8, torch.float32).zero_()
    step = torch.tensor(3.0)
    with sim.compute_scope():
        staging.add_(step)
        host.add_(step)
        torch._foreach_add_([staging], [torch.ones(8)])
    assert torch.equal(staging, torch.full((8,), 4.0))
    assert torch.equal(host, torch.full((8,), 3.0))
    assert sim.races == []


def test_adopted_parameters_are_device_memory() -> None:
    sim = SimBackend()
    param = torch.nn.Parameter(torch.ones(8))
    sim.adopt(param)
    host = sim.empty_host(8, torch.float32)
    with torch.no_grad(), sim.compute_scope(), pytest.raises(SimMixedDeviceError):
        param.add_(host)


# -- copy validation ---------------------------------------------------------------------------------------------------


def test_copy_from_a_plain_cpu_tensor_to_device_raises_pageable_error() -> None:
    sim = SimBackend()
    staging = sim.empty((8,), torch.float32)
    with pytest.raises(SimPageableCopyError) as caught:
        sim.copy(staging, torch.ones(8), stream=sim.new_stream())
    message = str(caught.value)
    assert "plain CPU tensor as src" in message
    assert "empty_host()" in message
    assert "adopt()" in message
    assert sim.copy_stats.h2d_copies == 0


def test_copy_between_a_plain_tensor_and_host_memory_treats_the_plain_side_as_device() -> None:
    sim = SimBackend(mode="sync")
    state = torch.arange(8.0)
    host = sim.empty_host(8, torch.float32)
    stream = sim.new_stream()
    sim.copy(host, state, stream=stream)
    sim.synchronize()
    assert torch.equal(host, state)
    assert sim.copy_stats.d2h_copies == 1


def test_device_to_device_copy_between_tracked_tensors() -> None:
    sim = SimBackend()
    param = torch.arange(6.0)
    sim.adopt(param)
    staging = sim.empty((6,), torch.float32)
    compute = sim.compute_stream()
    sim.copy(staging, param, stream=compute)  # compute stream: runs at once, no events needed
    assert torch.equal(staging, param)
    assert (sim.copy_stats.d2d_copies, sim.copy_stats.d2d_bytes) == (1, 24)


@pytest.mark.parametrize(
    ("dst_shape", "dst_dtype", "match"),
    [((4,), torch.float32, r"dst \(4,\) torch.float32 and src \(8,\)"), ((8,), torch.float64, "torch.float64")],
)
def test_copy_needs_matching_shapes_and_dtypes(dst_shape: tuple[int, ...], dst_dtype: torch.dtype, match: str) -> None:
    sim = SimBackend()
    host = sim.empty_host(8, torch.float32)
    staging = sim.empty(dst_shape, dst_dtype)
    with pytest.raises(ValueError, match=match):
        sim.copy(staging, host, stream=sim.new_stream())


def test_copy_between_two_host_buffers_is_refused() -> None:
    sim = SimBackend()
    with pytest.raises(ValueError, match="both host memory"):
        sim.copy(sim.empty_host(4, torch.float32), sim.empty_host(4, torch.float32), stream=sim.new_stream())


def test_streams_and_events_of_another_backend_are_refused() -> None:
    sim, other = SimBackend(), SimBackend()
    with pytest.raises(ValueError, match="not a stream of this SimBackend"):
        sim.record_event(other.new_stream())
    with pytest.raises(ValueError, match="not an event of this SimBackend"):
        sim.wait_event(sim.compute_stream(), other.record_event(other.compute_stream()))


# -- what the dispatch mode records --------------------------------------------------------------------------------


def test_schema_write_positions_cover_tensor_lists_and_out_arguments() -> None:
    assert op_access_pattern(aten._foreach_add_.List).write_positions == frozenset({0})
    assert op_access_pattern(aten.add.out).write_names == frozenset({"out"})
    assert op_access_pattern(aten.add.Tensor).write_positions == frozenset()
    assert op_access_pattern(aten.addcmul_.default).write_positions == frozenset({0})
    assert not op_access_pattern(aten.view.default).touches_data
    assert not op_access_pattern(aten.zeros_like.default).touches_data
    assert op_access_pattern(aten._local_scalar_dense.default).returns_host_value


def test_foreach_update_while_d2h_still_reads_is_a_race() -> None:
    sim = SimBackend()
    compute, d2h = sim.compute_stream(), sim.new_stream()
    staging = sim.empty((8,), torch.float32)
    host = sim.empty_host(8, torch.float32)
    sim.wait_event(d2h, sim.record_event(compute))
    sim.copy(host, staging, stream=d2h)
    with sim.compute_scope(), pytest.raises(SimRaceError, match=r"read by stream1 \(copy d2h\) and write by compute"):
        torch._foreach_mul_([staging], 2.0)
    sim.wait_event(compute, sim.record_event(d2h))
    with sim.compute_scope():
        torch._foreach_mul_([staging], 2.0)  # ordered now


def test_item_orders_the_host_after_the_compute_stream() -> None:
    """A D2H copy on the compute stream is safe to read on the host once the host waited for compute."""
    sim = SimBackend(poison=False)
    staging = sim.empty((4,), torch.float32)
    host = sim.empty_host(4, torch.float32)
    compute = sim.compute_stream()
    with sim.compute_scope():
        staging.fill_(1.0)
    sim.copy(host, staging, stream=compute)
    with sim.compute_scope(), pytest.raises(SimRaceError, match=r"write by compute \(copy d2h\) and read by host"):
        host.sum()
    with sim.compute_scope():
        assert staging[0].item() == 1.0  # reading a device value back blocks the host on the compute stream
        assert torch.equal(host.clone(), torch.ones(4))


def test_nested_scopes_keep_checking_after_the_inner_one_exits() -> None:
    sim = SimBackend()
    staging = sim.empty((2,), torch.float32)
    host = sim.empty_host(2, torch.float32)
    with sim.compute_scope():
        with sim.compute_scope():
            pass
        with pytest.raises(SimMixedDeviceError):
            staging.add_(host)
    assert _get_current_dispatch_mode() is None


# -- checks off: nothing intercepts ops -------------------------------------------------------------------------------


def test_checks_off_installs_no_dispatch_mode() -> None:
    sim = SimBackend(mode="sync", check_races=False)
    staging = sim.empty((4,), torch.float32).zero_()
    host = sim.empty_host(4, torch.float32).fill_(1.0)
    scope = sim.compute_scope()
    assert isinstance(scope, contextlib.nullcontext)
    with scope:
        assert _get_current_dispatch_mode() is None
        assert torch._C._len_torch_dispatch_stack() == 0
        staging.add_(host)  # mixing goes unnoticed: the checks exist only with check_races=True
    assert torch.equal(staging, torch.ones(4))
    assert sim.races == []


def test_checks_on_installs_a_dispatch_mode_only_inside_the_scope() -> None:
    sim = SimBackend()
    assert _get_current_dispatch_mode() is None
    with sim.compute_scope():
        assert _get_current_dispatch_mode() is not None
    assert torch._C._len_torch_dispatch_stack() == 0


def test_a_plain_tensor_copied_to_host_is_race_tracked_from_then_on() -> None:
    sim = SimBackend()
    state = torch.arange(4.0)  # an optimizer state torch created: plain until it takes part in a copy
    host = sim.empty_host(4, torch.float32)
    d2h = sim.new_stream()
    sim.copy(host, state, stream=d2h)
    assert sim.memory_kind(state) is MemoryKind.DEVICE
    with sim.compute_scope(), pytest.raises(SimRaceError, match=r"read by stream1 \(copy d2h\) and write by compute"):
        state.zero_()
    sim.synchronize()
    assert torch.equal(host, torch.arange(4.0))
