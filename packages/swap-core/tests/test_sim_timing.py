"""The simulator's virtual clock (SimBackend(timing=LinkModel(...))): exact modeled times, the same in every mode.

Times are assigned when work is issued, so they are checked here against hand computations, and a
swapped step's modeled seconds are compared between simulator modes (equal floats) and against the
pipeline bound of docs/simulator.md. These are deterministic model times, never wall-clock timings.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.backends.sim.timing import VirtualClock
from swap_core.runtime import pipeline
from swap_core.sim import LINK_PRESETS, LinkModel, MetaBackend, SimBackend

pytestmark = pytest.mark.sim_only

LINK = LinkModel(h2d_gbps=20.0, d2h_gbps=10.0, device_gbps=1000.0, launch_us=5.0, device_tflops=100.0)
LAUNCH = 5e-6
NUMEL = 1 << 18
NBYTES = NUMEL * 4


def _sim(link: LinkModel = LINK, mode: str = "lazy") -> SimBackend:
    return SimBackend(mode=mode, seed=3, check_races=False, poison=False, timing=link)  # type: ignore[arg-type]


def _host_and_device(sim: SimBackend) -> tuple[torch.Tensor, torch.Tensor]:
    return sim.empty_host(NUMEL, torch.float32), sim.empty((NUMEL,), torch.float32)


def test_link_model_checks_its_numbers_and_names_its_presets() -> None:
    theoretical = {"pcie4", "pcie5", "ascend-910b"}
    achievable = {f"{name}-achievable" for name in theoretical}
    assert set(LINK_PRESETS) == theoretical | achievable | {"pcie5-achievable-nic"}
    with_card = LinkModel.preset("pcie5-achievable-nic")
    assert dataclasses.replace(with_card, network_gbps=None) == LinkModel.preset("pcie5-achievable")
    assert with_card.network_gbps == 50.0 and with_card.collective_gbps("h2d") == 50.0
    for network in (0.0, -1.0, math.inf, "50"):
        with pytest.raises(ValueError, match=r"LinkModel.network_gbps must be None or a finite number > 0"):
            LinkModel(1.0, 1.0, 1.0, network_gbps=network)  # type: ignore[arg-type]
    assert LinkModel.preset("pcie5").h2d_gbps == 63.0
    with pytest.raises(ValueError, match=r"Unknown LinkModel preset 'pcie9'.*'pcie4'"):
        LinkModel.preset("pcie9")
    for field, value in (("h2d_gbps", 0.0), ("d2h_gbps", -1.0), ("device_gbps", math.inf), ("launch_us", -1.0)):
        arguments = {"h2d_gbps": 1.0, "d2h_gbps": 1.0, "device_gbps": 1.0, field: value}
        with pytest.raises(ValueError, match=rf"LinkModel.{field} must be a finite number"):
            LinkModel(**arguments)
    with pytest.raises(ValueError, match=r"LinkModel.duplex_factor must be in \[1, 2\], got 2.5"):
        LinkModel(1.0, 1.0, 1.0, duplex_factor=2.5)
    with pytest.raises(ValueError, match=r"LinkModel.duplex_factor must be a finite number > 0, got nan"):
        LinkModel(1.0, 1.0, 1.0, duplex_factor=math.nan)
    with pytest.raises(ValueError, match=r"LinkModel.host_memory_gbps must be None or a finite number > 0, got 0.0"):
        LinkModel(1.0, 1.0, 1.0, host_memory_gbps=0.0)
    for ranks in (0, 1.5, True):
        with pytest.raises(ValueError, match=rf"LinkModel.ranks_sharing_host must be an int >= 1, got {ranks!r}"):
            LinkModel(1.0, 1.0, 1.0, ranks_sharing_host=ranks)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timing must be a LinkModel"):
        SimBackend(timing="pcie4")  # type: ignore[arg-type]
    assert SimBackend().modeled_times() is None


def test_the_theoretical_presets_keep_their_numbers() -> None:
    """Theoretical rates, full duplex; a rank alone on its host (the host memory bounds nothing)."""
    expected = {  # h2d, d2h, device GB/s, launch µs, TFLOPS, duplex factor, host memory GB/s
        "pcie4": (31.5, 31.5, 1555.0, 5.0, 312.0, 2.0, 409.6),
        "pcie5": (63.0, 63.0, 3350.0, 5.0, 989.0, 2.0, 563.2),
        "ascend-910b": (31.5, 31.5, 1200.0, 5.0, 280.0, 2.0, None),
    }
    for name, numbers in expected.items():
        link = LinkModel.preset(name)
        fields = dataclasses.astuple(link)
        assert fields[:-2] == numbers and link.ranks_sharing_host == 1 and link.network_gbps is None, name
        assert link.copy_seconds("h2d", NBYTES) == NBYTES / (link.h2d_gbps * 1e9), name  # as before the host share
        assert link.concurrent_copy_seconds(NBYTES, NBYTES) == link.copy_seconds("d2h", NBYTES), "full duplex"


def test_the_achievable_presets_carry_the_measured_numbers() -> None:
    """Pinned copies as measured (nvbandwidth), both directions at once 1.4 x one, host memory at 80% of its wire
    rate; the device as in the theoretical preset (docs/simulator.md gives the sources)."""
    expected = {"pcie4": (25.5, 327.68), "pcie5": (55.0, 450.56), "ascend-910b": (25.5, None)}
    for name, (link_gbps, host_gbps) in expected.items():
        theoretical, achievable = LinkModel.preset(name), LinkModel.preset(f"{name}-achievable")
        assert (achievable.h2d_gbps, achievable.d2h_gbps, achievable.duplex_factor) == (link_gbps, link_gbps, 1.4)
        assert achievable.host_memory_gbps == host_gbps
        if host_gbps is not None:
            assert theoretical.host_memory_gbps is not None
            assert host_gbps == pytest.approx(0.8 * theoretical.host_memory_gbps, rel=1e-12)
        assert (achievable.device_gbps, achievable.device_tflops) == (
            theoretical.device_gbps,
            theoretical.device_tflops,
        )
        assert achievable.h2d_gbps < theoretical.h2d_gbps
    # 55 GB/s of PCIe 5's 63 alone; a copy-in beside an equal copy-out: 2 x 55 / 1.4 x 55 of one copy alone.
    pcie5 = LinkModel.preset("pcie5-achievable")
    assert pcie5.concurrent_copy_seconds(NBYTES, NBYTES) == pytest.approx(2 * NBYTES / (1.4 * 55e9), rel=1e-12)


DUPLEX = LinkModel(h2d_gbps=20.0, d2h_gbps=20.0, device_gbps=1000.0, launch_us=0.0, duplex_factor=1.6)
ALONE = NBYTES / 20e9


def test_a_duplex_overlapped_pair_of_copies_takes_longer_than_either_alone() -> None:
    """Both directions at once move duplex_factor x one direction's bytes. The copy issued first keeps the time it
    was given; the one issued beside it gets what is left, 0.6 of its bandwidth, until the first ends."""
    for first, second in (("h2d", "d2h"), ("d2h", "h2d")):
        alone = VirtualClock(DUPLEX)
        assert alone.issue_transfer("copy", second, NBYTES) == pytest.approx(ALONE, rel=1e-12)
        clock = VirtualClock(DUPLEX)
        assert clock.issue_transfer("in", first, NBYTES) == pytest.approx(ALONE, rel=1e-12)
        # 0.6 N while the first runs, the other 0.4 N alone: (3 - 1.6) x the copy alone.
        assert clock.issue_transfer("out", second, NBYTES) == pytest.approx(1.4 * ALONE, rel=1e-12)
        assert clock.transfers_started == 0.0 and clock.host == 0.0
    # A second copy of 0.6 N ends with the first: together they moved 1.6 N in the time of one N alone.
    clock = VirtualClock(DUPLEX)
    clock.issue_transfer("in", "h2d", NBYTES)
    assert clock.issue_transfer("out", "d2h", int(0.6 * NBYTES)) == pytest.approx(ALONE, rel=1e-6)
    # Full duplex (the theoretical presets): each direction at its own rate, as before.
    full = VirtualClock(dataclasses.replace(DUPLEX, duplex_factor=2.0))
    assert full.issue_transfer("in", "h2d", NBYTES) == full.issue_transfer("out", "d2h", NBYTES) == ALONE
    # A copy in one direction, or on the device, shares nothing with the other direction.
    clock = VirtualClock(DUPLEX)
    clock.issue_transfer("in", "h2d", NBYTES)
    assert clock.issue_transfer("device", "d2d", NBYTES) == 2 * NBYTES / 1000e9
    assert clock.issue_transfer("in", "h2d", NBYTES) == pytest.approx(2 * ALONE, rel=1e-12), "one stream serializes"


NIC = dataclasses.replace(DUPLEX, duplex_factor=2.0, network_gbps=10.0, host_memory_gbps=25.0)
"""A 20 GB/s full-duplex link whose network card moves 10 GB/s each way, on a host that gives the copies 25 GB/s."""


def test_a_collective_shares_the_link_with_the_copies_but_not_host_memory() -> None:
    # Alone: at the card's rate (below the link's).
    clock = VirtualClock(NIC)
    assert clock.issue_collective("net-in", "h2d", NBYTES) == pytest.approx(NBYTES / 10e9, rel=1e-12)
    assert clock.transfers_started is None, "a collective is not one of the step's copies"
    # Beside a copy in its direction: the copy issued first keeps its 20 GB/s, the collective waits for the link.
    clock = VirtualClock(NIC)
    assert clock.issue_transfer("in", "h2d", NBYTES) == pytest.approx(ALONE, rel=1e-12)
    assert clock.issue_collective("net-in", "h2d", NBYTES) == pytest.approx(ALONE + NBYTES / 10e9, rel=1e-12)
    # Issued first, the collective takes 10 GB/s of the direction: a copy beside it gets the other 10 (both end
    # together, at twice a copy alone), and a shorter one ends at N / 2 over 10 GB/s.
    clock = VirtualClock(NIC)
    clock.issue_collective("net-in", "h2d", NBYTES)
    assert clock.issue_transfer("in", "h2d", NBYTES) == pytest.approx(2 * ALONE, rel=1e-12)
    clock = VirtualClock(NIC)
    clock.issue_collective("net-in", "h2d", 2 * NBYTES)
    assert clock.issue_transfer("in", "h2d", NBYTES // 2) == pytest.approx(ALONE, rel=1e-12)
    # The other direction: full duplex leaves the copy its link, and the card reads no host memory, so the copy keeps
    # the whole host share (25 GB/s caps it: 20 GB/s of link).
    clock = VirtualClock(NIC)
    clock.issue_collective("net-out", "d2h", NBYTES)
    assert clock.issue_transfer("in", "h2d", NBYTES) == pytest.approx(ALONE, rel=1e-12)
    # Without a card on the link the collectives are not modeled: no time, nothing issued, copies unslowed.
    clock = VirtualClock(DUPLEX)
    assert clock.issue_collective("net-in", "h2d", NBYTES) == clock.host == 0.0
    assert clock.issue_transfer("in", "h2d", NBYTES) == pytest.approx(ALONE, rel=1e-12)


def test_the_transfer_bound_counts_the_collectives_on_the_link() -> None:
    """Copies of N each way beside collectives of N each way on a 20 GB/s full-duplex link: 2 N a direction."""
    assert NIC.concurrent_copy_seconds(NBYTES, NBYTES, collective_nbytes=NBYTES) == pytest.approx(2 * ALONE)
    assert NIC.concurrent_copy_seconds(NBYTES, NBYTES) == pytest.approx(2 * NBYTES / 25e9), "the host share"
    assert DUPLEX.concurrent_copy_seconds(NBYTES, 0, collective_nbytes=NBYTES) == ALONE, "no card on the link"
    # The card's own rate bounds the collectives alone: N at 10 GB/s.
    assert NIC.concurrent_copy_seconds(0, 0, collective_nbytes=NBYTES) == pytest.approx(NBYTES / 10e9)


def test_a_modeled_collective_delays_the_stream_that_waits_for_it() -> None:
    """SimBackend.model_collective puts a ring's bytes in and out on the clock; model_wait holds the current
    stream until they have arrived."""
    sim = _sim(dataclasses.replace(NIC, launch_us=0.0))
    arrived = sim.model_collective(NBYTES, NBYTES)
    assert arrived == pytest.approx(NBYTES / 10e9, rel=1e-12)
    sim.model_wait(arrived)
    sim.model_compute(1e-3)
    times = sim.modeled_times()
    assert times is not None and times.compute == pytest.approx(arrived + 1e-3, rel=1e-12)
    with pytest.raises(ValueError, match="model_collective needs bytes >= 0"):
        sim.model_collective(-1, 0)
    with pytest.raises(ValueError, match=r"model_wait needs a virtual clock"):
        SimBackend().model_wait(1.0)


def test_ranks_sharing_host_memory_slow_copies_when_the_host_is_the_bottleneck() -> None:
    """8 ranks of a host with 80 GB/s of memory get 10 GB/s each: below the 20 GB/s link, copies take twice as long;
    2 ranks get 40 GB/s each and the link stays the bottleneck."""
    link = LinkModel(h2d_gbps=20.0, d2h_gbps=10.0, device_gbps=1000.0, launch_us=5.0, host_memory_gbps=80.0)
    for ranks, h2d_gbps in ((1, 20.0), (2, 20.0), (8, 10.0), (16, 5.0)):
        sim = _sim(dataclasses.replace(link, ranks_sharing_host=ranks))
        host, device = _host_and_device(sim)
        sim.copy(device, host, stream=sim.new_stream())
        times = sim.modeled_times()
        assert times is not None and times.transfers == pytest.approx(NBYTES / (h2d_gbps * 1e9), rel=1e-12), ranks
    # Both directions together share the host too: 30 GB/s for a 20 GB/s full-duplex link. The copy issued second
    # gets 10 GB/s while the first runs, then 20: it ends at 1.5 x a copy alone.
    shared = LinkModel(h2d_gbps=20.0, d2h_gbps=20.0, device_gbps=1000.0, launch_us=0.0, host_memory_gbps=30.0)
    clock = VirtualClock(shared)
    assert clock.issue_transfer("in", "h2d", NBYTES) == pytest.approx(ALONE, rel=1e-12)
    assert clock.issue_transfer("out", "d2h", NBYTES) == pytest.approx(1.5 * ALONE, rel=1e-12)
    assert shared.concurrent_copy_seconds(NBYTES, NBYTES) == pytest.approx(2 * NBYTES / 30e9, rel=1e-12)


def test_a_copy_lasts_its_bytes_over_the_link_and_a_wait_carries_its_time() -> None:
    sim = _sim()
    host, device = _host_and_device(sim)
    h2d = sim.new_stream()
    sim.copy(device, host, stream=h2d)  # issued at 0: [0, N/20 GB/s]
    copied = sim.record_event(h2d)
    sim.wait_event(sim.compute_stream(), copied)
    times = sim.modeled_times()
    assert times is not None
    assert times.transfers == pytest.approx(NBYTES / 20e9, rel=1e-12)
    assert times.compute == times.transfers, "the compute stream waits for the copy"
    assert times.host == pytest.approx(LAUNCH), "the host issued one op and never waited"
    sim.model_compute(1e-3)
    times = sim.modeled_times()
    assert times is not None and times.compute == pytest.approx(NBYTES / 20e9 + 1e-3, rel=1e-12)
    sim.synchronize()
    times = sim.modeled_times()
    assert times is not None and times.host == times.compute, "synchronize: the host waits for every stream"


def test_two_copy_streams_overlap_and_one_stream_serializes_both_directions() -> None:
    for duplex in (True, False):
        sim = _sim()
        host_in, device_in = _host_and_device(sim)
        host_out, device_out = _host_and_device(sim)
        h2d = sim.new_stream()
        d2h = sim.new_stream() if duplex else h2d
        sim.copy(device_in, host_in, stream=h2d)
        sim.copy(host_out, device_out, stream=d2h)
        times = sim.modeled_times()
        assert times is not None
        both = NBYTES / 20e9 + NBYTES / 10e9
        # Duplex: the device-to-host copy starts when the host issued it, one launch after the first.
        expected = max(NBYTES / 20e9, LAUNCH + NBYTES / 10e9) if duplex else both
        assert times.transfers == pytest.approx(expected, rel=1e-12), duplex


def test_compute_ops_last_their_bytes_over_device_bandwidth_and_matmuls_their_flops() -> None:
    sim = _sim()
    a, b = sim.empty((NUMEL,), torch.float32), sim.empty((NUMEL,), torch.float32)
    with sim.compute_scope():
        a.add_(b)  # reads a and b, writes a: three tensors' bytes
    times = sim.modeled_times()
    assert times is not None and times.compute == pytest.approx(3 * NBYTES / 1000e9, rel=1e-12)
    left, right = sim.empty((512, 512), torch.float32), sim.empty((512, 512), torch.float32)
    with sim.compute_scope():
        torch.mm(left, right)
    after = sim.modeled_times()
    assert after is not None
    flops_seconds = 2 * 512**3 / 100e12
    bytes_seconds = 3 * 512 * 512 * 4 / 1000e9
    start = max(times.compute, LAUNCH)  # issued after the add's launch
    assert after.compute == pytest.approx(start + max(flops_seconds, bytes_seconds), rel=1e-12)


def _adamw_step_times(
    mode: str, *, swap_times: int = 4, duplex: bool = True, link: LinkModel = LINK
) -> tuple[float, float, int]:
    """A warm (second) step of swapped AdamW over 16 equal fp32 parameters, the device idle at entry."""
    sim = _sim(link, mode)
    params = [torch.nn.Parameter(torch.randn(NUMEL, generator=torch.Generator().manual_seed(i))) for i in range(16)]
    config = SwapConfig(backend=sim, swap_times=swap_times, duplex=duplex)
    optimizer = swap_optimizer(torch.optim.AdamW(params, lr=1e-3, foreach=True), config)
    for _ in range(2):
        for param in params:
            param.grad = torch.ones_like(param)
        sim.synchronize()
        optimizer.step()
    stats = optimizer.stats
    assert stats.modeled_step_seconds is not None and stats.modeled_transfer_seconds is not None
    return stats.modeled_step_seconds, stats.modeled_transfer_seconds, stats.h2d_bytes


def test_a_steps_modeled_seconds_are_the_same_in_every_simulator_mode() -> None:
    times = {mode: _adamw_step_times(mode) for mode in ("lazy", "sync", "random")}
    assert times["lazy"] == times["sync"] == times["random"], times
    assert SwapConfig().backend == "auto"  # no timing model on any default path
    assert _adamw_step_times("lazy")[0] > 0


@pytest.fixture
def planted_wait() -> Iterator[None]:
    """The update of batch i also waits for the copy-out of batch i - 1: an extra wait that serializes."""
    update, offload = pipeline.PipelineScheduler.update_batch, pipeline.PipelineScheduler.offload_batch
    last: dict[int, object] = {}

    def offload_and_remember(
        self: pipeline.PipelineScheduler, batch: object, stats: object, *, to_spare: bool = False
    ) -> object:
        events = offload(self, batch, stats, to_spare=to_spare)  # type: ignore[arg-type]
        last[id(self)] = events.done
        return events

    def update_after_previous_offload(self: pipeline.PipelineScheduler, *args: object) -> None:
        if id(self) in last:
            self.backend.wait_event(self.compute, last[id(self)])  # type: ignore[arg-type]
        update(self, *args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline.PipelineScheduler, "offload_batch", offload_and_remember)
        patch.setattr(pipeline.PipelineScheduler, "update_batch", update_after_previous_offload)
        yield


BOUND = 1.02
"""Issue 14's goal for a cold duplex step: modeled transfer time <= 1.02 x (max(S/B↓, S/B↑)·(1 + 1/k) + T_c/k).
This workload (16 equal parameters, k = 4, PCIe 4) comes to 1.015."""


def _cold_step_ratio() -> float:
    _, transfer, swapped = _adamw_step_times("lazy", link=LinkModel.preset("pcie4"))
    fast_link = LinkModel(h2d_gbps=1e6, d2h_gbps=1e6, device_gbps=1555.0, device_tflops=312.0)
    update_seconds = _adamw_step_times("lazy", link=fast_link)[0]  # T_c: the step with copies taking no time
    link = LinkModel.preset("pcie4")
    bound = max(swapped / (link.h2d_gbps * 1e9), swapped / (link.d2h_gbps * 1e9)) * (1 + 1 / 4) + update_seconds / 4
    return transfer / bound


def test_a_cold_duplex_step_is_near_the_pipeline_bound() -> None:
    assert _cold_step_ratio() <= BOUND


@pytest.mark.usefixtures("planted_wait")
def test_a_planted_extra_wait_breaks_the_bound() -> None:
    assert _cold_step_ratio() > BOUND  # 1.07 with the planted wait


def test_one_copy_stream_is_told_apart_from_two() -> None:
    """Both directions on one stream serialize: 1.87x the duplex time at k = 16 here (issue 14 asks 1.8x). Before
    copies were cut at the arena's middle it was 1.76x: batch i + 1's copy-in waited for all of batch i - 1's
    copy-out."""
    link = LinkModel.preset("pcie4")
    duplex = _adamw_step_times("lazy", duplex=True, swap_times=16, link=link)[1]
    one_stream = _adamw_step_times("lazy", duplex=False, swap_times=16, link=link)[1]
    assert one_stream >= 1.8 * duplex, (one_stream, duplex)


def test_a_trace_on_the_virtual_clock_shows_copies_overlapping_updates() -> None:
    sim = _sim(LinkModel.preset("pcie4"))
    params = [torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(8)]
    optimizer = swap_optimizer(torch.optim.AdamW(params, lr=1e-3), SwapConfig(backend=sim, swap_times=4, trace=True))
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert optimizer.trace is not None
    spans = {(interval.batch, interval.phase): interval for interval in optimizer.trace.intervals}
    copy_in = spans[(1, "h2d")]
    assert copy_in.nbytes >= 4 * NBYTES  # two parameters, two moments each
    assert copy_in.end - copy_in.start == pytest.approx(copy_in.nbytes / 31.5e9, rel=1e-9)
    update = spans[(0, "update")]
    assert copy_in.start < update.end and update.start < copy_in.end, "batch 1 comes in while batch 0 updates"


def test_the_clock_runs_beside_the_race_checker_and_poison() -> None:
    """With every check on, the modeled times are those of the unchecked run (the checks take no modeled time)."""
    times = []
    for checked in (True, False):
        sim = SimBackend(mode="random", seed=2, check_races=checked, poison=checked, timing=LinkModel.preset("pcie5"))
        params = [torch.nn.Parameter(torch.randn(4096)) for _ in range(6)]
        optimizer = swap_optimizer(torch.optim.AdamW(params), SwapConfig(backend=sim, swap_times=3, min_numel=16))
        for _ in range(3):
            for param in params:
                param.grad = torch.ones_like(param)
            optimizer.step()
        assert not sim.races
        times.append((optimizer.stats.modeled_step_seconds, optimizer.stats.modeled_transfer_seconds))
    assert times[0] == times[1], times


def _warm_step_with_prefetch(link: LinkModel, *, prefetch: bool) -> tuple[float, int, SimBackend]:
    """AdamW's third step, batch 0 prefetched (or not) before 5 ms of modeled backward; returns the step's modeled
    seconds, its swapped bytes and the backend."""
    sim = _sim(link)
    params = [torch.nn.Parameter(torch.randn(NUMEL, generator=torch.Generator().manual_seed(i))) for i in range(16)]
    optimizer = swap_optimizer(torch.optim.AdamW(params, lr=1e-3, foreach=True), SwapConfig(backend=sim, swap_times=4))
    for _ in range(3):
        for param in params:
            param.grad = torch.ones_like(param)
        if prefetch:
            optimizer.prefetch()
        sim.model_compute(5e-3)
        optimizer.step()
    assert optimizer.stats.modeled_step_seconds is not None
    return optimizer.stats.modeled_step_seconds, optimizer.stats.h2d_bytes, sim


def test_with_prefetch_and_no_end_wait_a_step_costs_the_loop_near_the_hidden_bound() -> None:
    """Issue 14's goal: modeled_step_seconds <= 1.05 x (max(S/B↓, S/B↑)·(1 - 1/k) + T_c/k), here 1.045 at k = 4:
    batch 0 came in during the backward, and the last copy-out runs into the next forward."""
    link = LinkModel.preset("pcie4")
    step, swapped, sim = _warm_step_with_prefetch(link, prefetch=True)
    fast_link = LinkModel(h2d_gbps=1e6, d2h_gbps=1e6, device_gbps=1555.0, device_tflops=312.0)
    update_seconds, _, _ = _warm_step_with_prefetch(fast_link, prefetch=False)
    bound = swapped / (link.h2d_gbps * 1e9) * (1 - 1 / 4) + update_seconds / 4
    assert step <= 1.05 * bound, (step, bound)
    times = sim.modeled_times()
    assert times is not None and times.compute < times.transfers, "the compute stream did not wait for the last offload"
    without_prefetch, _, _ = _warm_step_with_prefetch(link, prefetch=False)
    assert without_prefetch > 1.3 * bound, "without prefetch the first copy-in is on the step's path"


def _meta_adamw_transfer_ratio(swap_times: int) -> float:
    """A cold duplex step over 16 fp32 parameters of 16M elements (meta tensors) against the pipeline bound."""

    def step(link: LinkModel) -> tuple[float, float, int]:
        backend = MetaBackend(link)
        params = [torch.nn.Parameter(torch.empty(1 << 24, device="meta")) for _ in range(16)]
        for param in params:
            param.grad = torch.empty_like(param)
        config = SwapConfig(backend=backend, swap_times=swap_times)
        optimizer = swap_optimizer(torch.optim.AdamW(params, lr=1e-3, foreach=True), config)
        optimizer.step()
        backend.synchronize()
        optimizer.step()
        stats = optimizer.stats
        assert stats.modeled_step_seconds is not None and stats.modeled_transfer_seconds is not None
        return stats.modeled_step_seconds, stats.modeled_transfer_seconds, stats.h2d_bytes

    link = LinkModel.preset("pcie4")
    _, transfer, swapped = step(link)
    update_seconds = step(LinkModel(h2d_gbps=1e6, d2h_gbps=1e6, device_gbps=1555.0, device_tflops=312.0))[0]
    bound = swapped / (link.h2d_gbps * 1e9) * (1 + 1 / swap_times) + update_seconds / swap_times
    return transfer / bound


@pytest.mark.parametrize("swap_times", [4, 8, 16])
def test_a_cold_step_of_large_tensors_stays_at_the_bound_with_many_batches(swap_times: int) -> None:
    """With 64 MiB tensors the update is 14% of a batch's copy; waiting for the whole copy-out of batch i - 1
    before copying batch i + 1 into its arena cost 2.7% / 4.6% / 5.8% at k = 4 / 8 / 16. Cut at the arena's
    middle, the copy-in overlaps the copy-out's second half: 1.000 x the bound at every k."""
    assert _meta_adamw_transfer_ratio(swap_times) <= 1.005


@pytest.fixture
def whole_arena_after_first_half() -> Iterator[None]:
    """A missing wait: the copy-in of batch i + 1 waits only for the first half of batch i - 1's copy-out."""
    prefetch = pipeline.PipelineScheduler.prefetch_batch

    def prefetch_too_early(
        self: pipeline.PipelineScheduler, batch: object, stats: object, *, reused: object = None
    ) -> object:
        if isinstance(reused, pipeline.Offloaded):
            reused = pipeline.Offloaded(reused.front, reused.front)
        return prefetch(self, batch, stats, reused=reused)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline.PipelineScheduler, "prefetch_batch", prefetch_too_early)
        yield


@pytest.mark.usefixtures("whole_arena_after_first_half")
@pytest.mark.parametrize("buffers", [2, 3])
def test_the_race_checker_catches_a_second_half_copied_in_too_early(buffers: int) -> None:
    sim = SimBackend(mode="lazy", seed=0, on_race="record")
    params = [torch.nn.Parameter(torch.randn(4096)) for _ in range(8)]
    config = SwapConfig(backend=sim, swap_times=4, staging_buffers=buffers)
    optimizer = swap_optimizer(torch.optim.AdamW(params), config)
    for _ in range(2):
        for param in params:
            param.grad = torch.ones_like(param)
        optimizer.step()
    # The second half of an arena, written by a copy-in while the copy-out still reads it (and then the update
    # reading what the copy-in wrote too early).
    assert any("(copy d2h) and write by" in race and "(copy h2d) are not ordered" in race for race in sim.races)


def test_a_simulated_copy_in_beside_a_copy_out_shares_the_link() -> None:
    link = LinkModel(h2d_gbps=20.0, d2h_gbps=20.0, device_gbps=1000.0, launch_us=0.0, duplex_factor=1.6)
    sim = _sim(link)
    host_in, device_in = _host_and_device(sim)
    host_out, device_out = _host_and_device(sim)
    sim.copy(device_in, host_in, stream=sim.new_stream())
    sim.copy(host_out, device_out, stream=sim.new_stream())
    times = sim.modeled_times()
    assert times is not None and times.transfers == pytest.approx(1.4 * NBYTES / 20e9, rel=1e-12)
