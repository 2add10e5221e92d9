"""Mini swap pipelines written against the SimBackend API: correct ones pass, each missing wait is caught."""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swap_core.backends.protocol import Event
from swap_core.errors import SimRaceError, SimUseAfterFreeError
from swap_core.sim import SimBackend

pytestmark = pytest.mark.sim_only  # tests of the simulator itself: skipped with --backend cuda|npu

MISSING_WAITS = ("alloc", "prefetch", "offload", "free")


def run_pipeline(
    sim: SimBackend, values: torch.Tensor, *, skip: str | None = None, release: bool = True
) -> torch.Tensor:
    """One state through H2D -> update (x * 2 + 1) -> D2H; ``skip`` leaves out one wait. Returns what the host reads.

    Queued work may remain (a missing wait can leave a copy behind): callers synchronize.
    """
    assert skip is None or skip in MISSING_WAITS
    compute, h2d, d2h = sim.compute_stream(), sim.new_stream(), sim.new_stream()
    host = sim.empty_host(values.numel(), values.dtype).view(values.shape)
    host.copy_(values)
    staging = sim.empty(values.shape, values.dtype)
    if skip != "alloc":
        sim.wait_event(h2d, sim.record_event(compute))
    sim.copy(staging, host, stream=h2d)
    prefetched = sim.record_event(h2d)
    if skip != "prefetch":
        sim.wait_event(compute, prefetched)
    with sim.compute_scope():
        staging.mul_(2).add_(1)
    sim.wait_event(d2h, sim.record_event(compute))
    sim.copy(host, staging, stream=d2h)
    offloaded = sim.record_event(d2h)
    if release:
        if skip != "free":
            sim.wait_event(compute, offloaded)
        sim.release_storage(staging)
    if skip != "offload":
        offloaded.synchronize()
    with sim.compute_scope():
        return host.clone()


VALUES = torch.arange(12, dtype=torch.float32).reshape(3, 4)
EXPECTED = VALUES * 2 + 1


@pytest.mark.parametrize(("mode", "seed"), [("sync", 0), ("lazy", 0), *[("random", seed) for seed in range(20)]])
def test_correct_pipeline_gives_right_numbers_without_races(mode: str, seed: int) -> None:
    sim = SimBackend(mode=mode, seed=seed)  # type: ignore[arg-type]
    result = run_pipeline(sim, VALUES)
    sim.synchronize()
    assert torch.equal(result, EXPECTED)
    assert sim.races == []
    assert sim.memory_allocated() == 0
    assert sim.max_memory_allocated() == VALUES.numel() * 4
    assert sim.pending_ops() == 0


def test_missing_prefetch_wait_reads_poison_in_lazy_mode() -> None:
    sim = SimBackend(mode="lazy", check_races=False)
    result = run_pipeline(sim, VALUES, skip="prefetch")
    assert torch.isnan(result).all()
    # The H2D copy nobody waited for is still queued. Without checks released memory stays mapped (like a
    # caching allocator's free block), so the late copy lands there as it would on a device: no crash.
    assert sim.pending_ops() == 1
    sim.synchronize()
    assert sim.pending_ops() == 0


def test_late_copy_into_released_memory_raises_with_checks() -> None:
    sim = SimBackend(mode="lazy", on_race="record")
    run_pipeline(sim, VALUES, skip="prefetch")
    assert sim.pending_ops() == 1
    with pytest.raises(SimUseAfterFreeError, match="h2d copy ran after the storage of its destination"):
        sim.synchronize()


def test_missing_prefetch_wait_raises_race_naming_both_sides() -> None:
    sim = SimBackend(mode="lazy")
    with pytest.raises(SimRaceError) as caught:
        run_pipeline(sim, VALUES, skip="prefetch")
    message = str(caught.value)
    assert "device memory" in message
    assert "bytes [0, 48)" in message
    assert "write by stream1 (copy h2d)" in message
    assert "by compute (aten::mul_.Tensor)" in message
    assert sim.races == [message]


def test_recorded_race_and_wrong_number_together() -> None:
    sim = SimBackend(mode="lazy", on_race="record")
    result = run_pipeline(sim, VALUES, skip="prefetch", release=False)
    gc.collect()  # the pipeline's host buffer, let go of with its copy in flight, is reported when collected
    assert torch.isnan(result).all()
    # Every later op touching what the unwaited H2D copy touches is reported once per pair, and the host buffer
    # the copy reads is let go of while the copy is still in flight.
    assert len(sim.races) == 5
    assert "write by stream1 (copy h2d) and write by compute (aten::mul_.Tensor)" in sim.races[0]
    assert "compute must wait_event on an event recorded on stream1 after the copy h2d" in sim.races[0]
    assert "write by compute (aten::add_.Tensor)" in sim.races[1]
    assert "Race on host memory" in sim.races[2]
    assert "read by stream1 (copy h2d) and write by stream2 (copy d2h)" in sim.races[2]
    assert "write by stream1 (copy h2d) and read by stream2 (copy d2h)" in sim.races[3]
    assert "read by stream1 (copy h2d) and write by host (free of a registered host buffer)" in sim.races[4]


@pytest.mark.parametrize("mode", ["sync", "lazy", "random"])
def test_missing_offload_wait_is_a_race_on_host_memory(mode: str) -> None:
    sim = SimBackend(mode=mode)  # type: ignore[arg-type]
    with pytest.raises(SimRaceError, match=r"host memory .*write by stream2 \(copy d2h\) and read by host"):
        run_pipeline(sim, VALUES, skip="offload")


def test_missing_offload_wait_reads_stale_values_in_lazy_mode() -> None:
    sim = SimBackend(mode="lazy", check_races=False)
    # Staging kept between steps: nothing else forces the D2H copy before the host reads.
    result = run_pipeline(sim, VALUES, skip="offload", release=False)
    assert torch.equal(result, VALUES)  # the D2H copy has not landed: the host sees the old state


@pytest.mark.parametrize("mode", ["sync", "lazy", "random"])
def test_free_before_offload_finished_is_a_race(mode: str) -> None:
    sim = SimBackend(mode=mode)  # type: ignore[arg-type]
    with pytest.raises(SimRaceError, match=r"read by stream2 \(copy d2h\) and write by compute \(release_storage\)"):
        run_pipeline(sim, VALUES, skip="free")


def test_free_before_offload_finished_reads_poison_without_checks() -> None:
    # Without checks released memory stays mapped but is poisoned at release: the late D2H copies NaN home.
    sim = SimBackend(mode="lazy", check_races=False)
    assert torch.isnan(run_pipeline(sim, VALUES, skip="free")).all()


def test_free_before_offload_finished_raises_with_checks_recording_races() -> None:
    sim = SimBackend(mode="lazy", on_race="record")
    with pytest.raises(SimUseAfterFreeError, match="d2h copy ran after the storage of its source was released"):
        run_pipeline(sim, VALUES, skip="free")


@pytest.mark.parametrize("mode", ["sync", "lazy", "random"])
def test_copy_into_fresh_memory_without_allocation_event_is_a_race(mode: str) -> None:
    sim = SimBackend(mode=mode)  # type: ignore[arg-type]
    with pytest.raises(SimRaceError, match=r"write by compute \(empty \(allocation\)\) and write by stream1"):
        run_pipeline(sim, VALUES, skip="alloc")
    assert sim.pending_ops() == 0  # the racing copy was refused, not queued


def test_random_mode_sometimes_runs_copies_early() -> None:
    """The same buggy pipeline is lucky under some seeds and not others: copies really run at random points."""
    outcomes = set()
    for seed in range(20):
        sim = SimBackend(mode="random", seed=seed, check_races=False)
        result = run_pipeline(sim, VALUES, skip="prefetch", release=False)
        outcomes.add("nan" if torch.isnan(result).all() else "right" if torch.equal(result, EXPECTED) else "other")
    assert "nan" in outcomes
    assert "right" in outcomes


def test_random_mode_is_deterministic_for_a_seed() -> None:
    def pending_trace(seed: int) -> list[int]:
        sim = SimBackend(mode="random", seed=seed)
        compute, h2d = sim.compute_stream(), sim.new_stream()
        host = sim.empty_host(64, torch.float32)
        host.fill_(1.0)
        staging = [sim.empty((8,), torch.float32) for _ in range(8)]
        sim.wait_event(h2d, sim.record_event(compute))
        trace = []
        for index, tensor in enumerate(staging):
            sim.copy(tensor, host[index * 8 : (index + 1) * 8], stream=h2d)
            trace.append(sim.pending_ops())
        sim.synchronize()
        return trace

    assert pending_trace(7) == pending_trace(7)
    assert len({tuple(pending_trace(seed)) for seed in range(6)}) > 1


# -- many states, shared streams, any legal interleaving -------------------------------------------------------------


@dataclass
class _StateInFlight:
    values: torch.Tensor
    host: torch.Tensor
    staging: torch.Tensor | None = None
    prefetched: Event | None = None
    offloaded: Event | None = None
    stage: int = 0


@dataclass
class _Pipeline:
    sim: SimBackend
    states: list[_StateInFlight] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.compute = self.sim.compute_stream()
        self.h2d = self.sim.new_stream()
        self.d2h = self.sim.new_stream()

    def advance(self, state: _StateInFlight) -> None:
        sim = self.sim
        if state.stage == 0:  # prefetch into fresh memory
            state.staging = sim.empty(state.values.shape, state.values.dtype)
            sim.wait_event(self.h2d, sim.record_event(self.compute))
            sim.copy(state.staging, state.host, stream=self.h2d)
            state.prefetched = sim.record_event(self.h2d)
        elif state.stage == 1:  # update on the compute stream
            assert state.staging is not None and state.prefetched is not None
            sim.wait_event(self.compute, state.prefetched)
            with sim.compute_scope():
                torch._foreach_mul_([state.staging], 3.0)
                state.staging.sub_(1)
        elif state.stage == 2:  # offload
            assert state.staging is not None
            sim.wait_event(self.d2h, sim.record_event(self.compute))
            sim.copy(state.host, state.staging, stream=self.d2h)
            state.offloaded = sim.record_event(self.d2h)
        else:  # free the staging memory once the offload is done
            assert state.staging is not None and state.offloaded is not None
            sim.wait_event(self.compute, state.offloaded)
            sim.release_storage(state.staging)
        state.stage += 1


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    order_seed=st.integers(0, 2**16),
    mode=st.sampled_from(["lazy", "random", "sync"]),
    sim_seed=st.integers(0, 2**16),
)
def test_any_legal_interleaving_of_correct_pipelines_has_no_races(
    sizes: list[int], order_seed: int, mode: str, sim_seed: int
) -> None:
    sim = SimBackend(mode=mode, seed=sim_seed)  # type: ignore[arg-type]
    pipeline = _Pipeline(sim)
    for index, size in enumerate(sizes):
        values = torch.arange(size, dtype=torch.float32) + 10 * index
        host = sim.empty_host(size, torch.float32)
        host.copy_(values)
        pipeline.states.append(_StateInFlight(values, host))
    order = random.Random(order_seed)
    while unfinished := [state for state in pipeline.states if state.stage < 4]:
        pipeline.advance(order.choice(unfinished))
    sim.synchronize()
    with sim.compute_scope():
        for state in pipeline.states:
            assert torch.equal(state.host, state.values * 3 - 1)
    assert sim.races == []
    assert sim.memory_allocated() == 0
