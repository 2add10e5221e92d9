"""One-shot copy faults and exact copy counters of SimBackend."""

from __future__ import annotations

import pytest
import torch

from swap_core.errors import SimError, SimInjectedFault
from swap_core.sim import SimBackend

pytestmark = pytest.mark.sim_only  # tests of the simulator itself: skipped with --backend cuda|npu


class _Pair:
    """A host buffer and a device tensor with the allocation already ordered before both copy streams."""

    def __init__(self, sim: SimBackend, numel: int = 4) -> None:
        self.sim = sim
        self.compute, self.h2d, self.d2h = sim.compute_stream(), sim.new_stream(), sim.new_stream()
        self.host = sim.empty_host(numel, torch.float32)
        self.host.copy_(torch.arange(float(numel)))
        self.device = sim.empty((numel,), torch.float32)
        allocated = sim.record_event(self.compute)
        sim.wait_event(self.h2d, allocated)
        sim.wait_event(self.d2h, allocated)

    def h2d_copy(self) -> None:
        self.sim.wait_event(self.h2d, self.sim.record_event(self.d2h))
        self.sim.copy(self.device, self.host, stream=self.h2d)

    def d2h_copy(self) -> None:
        self.sim.wait_event(self.d2h, self.sim.record_event(self.h2d))
        self.sim.copy(self.host, self.device, stream=self.d2h)


def test_fault_fires_once_at_the_chosen_copy() -> None:
    sim = SimBackend()
    pair = _Pair(sim)
    sim.fail_copy(2)
    pair.h2d_copy()
    pair.d2h_copy()
    sim.wait_event(pair.h2d, sim.record_event(pair.d2h))
    pending = sim.pending_ops()
    with pytest.raises(SimInjectedFault, match="Injected fault on a h2d copy of 16 bytes"):
        sim.copy(pair.device, pair.host, stream=pair.h2d)
    assert sim.pending_ops() == pending  # nothing was issued
    assert (sim.copy_stats.h2d_copies, sim.copy_stats.d2h_copies) == (1, 1)
    pair.h2d_copy()  # one shot: the next copy goes through
    assert sim.copy_stats.h2d_copies == 2
    sim.synchronize()
    assert sim.races == []


def test_fault_can_count_one_direction_only() -> None:
    sim = SimBackend()
    pair = _Pair(sim)
    sim.fail_copy(1, direction="d2h")
    pair.h2d_copy()
    pair.d2h_copy()  # d2h number 0
    pair.h2d_copy()
    with pytest.raises(SimInjectedFault, match="d2h copy"):
        pair.d2h_copy()  # d2h number 1
    assert sim.copy_stats.h2d_copies == 2
    assert sim.copy_stats.d2h_copies == 1


def test_injected_fault_is_a_runtime_error() -> None:
    assert issubclass(SimInjectedFault, SimError)
    assert issubclass(SimInjectedFault, RuntimeError)


def test_fault_at_zero_fires_on_the_next_copy() -> None:
    sim = SimBackend()
    pair = _Pair(sim)
    sim.fail_copy(0)
    with pytest.raises(SimInjectedFault):
        pair.h2d_copy()


def test_rearming_replaces_the_armed_fault() -> None:
    sim = SimBackend()
    pair = _Pair(sim)
    sim.fail_copy(0)
    sim.fail_copy(1)
    pair.h2d_copy()
    with pytest.raises(SimInjectedFault):
        pair.h2d_copy()


@pytest.mark.parametrize(
    ("at", "direction", "match"),
    [(-1, None, "Invalid fault position: -1"), (True, None, "Invalid fault position"), (0, "up", "'up'")],
)
def test_fail_copy_validates_its_arguments(at: int, direction: str | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SimBackend().fail_copy(at, direction)


def test_copy_stats_count_copies_and_bytes_at_issue_and_reset_in_place() -> None:
    sim = SimBackend(mode="lazy")
    pair = _Pair(sim, numel=6)
    stats = sim.copy_stats
    pair.h2d_copy()
    pair.h2d_copy()
    pair.d2h_copy()
    assert sim.pending_ops() > 0  # counted although nothing ran yet
    assert (stats.h2d_copies, stats.h2d_bytes, stats.d2h_copies, stats.d2h_bytes) == (2, 48, 1, 24)
    sim.reset_copy_stats()
    assert stats is sim.copy_stats
    assert (stats.h2d_copies, stats.h2d_bytes, stats.d2h_copies, stats.d2h_bytes) == (0, 0, 0, 0)
    sim.synchronize()
