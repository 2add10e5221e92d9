"""swap-bench --quick as a CI smoke test: the JSON schema and exact byte/copy counts, never timings."""

from __future__ import annotations

import importlib.util
import json
import mmap
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from swap_bench import main, run_bench
from swap_bench.comparisons import Baseline, ComparisonConfig, HostMasterOffload, plan_comparisons
from swap_bench.measure import BaselineOptimizer, measure_comparison
from swap_bench.report import SCHEMA, render_table
from swap_bench.workloads import ADAMW_KWARGS, QUICK_WORKLOADS
from swap_core.backends.host_memory import pinned_size
from swap_core.backends.protocol import DeviceBackend
from swap_core.sim import SimBackend

pytestmark = pytest.mark.sim_only

ROW_FIELDS = {
    "workload", "optimizer", "swap_times", "packed", "duplex", "params", "plain_step_s", "swapped_step_s", "ratio",
    "swapped_state_bytes", "h2d_bytes", "d2h_bytes", "h2d_copies", "d2h_copies", "batches", "achieved_gbps",
    "added_s", "copy_floor_s", "copy_floor_efficiency", "copies_alone_s", "overhead_per_batch_s", "ideal_step_s",
    "ideal_percent",
    "peak_state_device_bytes_swapped", "peak_state_device_bytes_unswapped", "host_state_bytes", "host_pinned_bytes",
}  # fmt: skip


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = ["--quick", "--backend", "sim", "--optimizers", "rmsprop", "--workloads", "many_small", "mixed_bf16_fp32"]
    assert main([*argv, "--json", str(path)]) == 0
    document: dict[str, Any] = json.loads(Path(path).read_text())
    return document


def test_schema(report: dict[str, Any]) -> None:
    assert report["schema"] == SCHEMA == "swap-bench/9"
    assert report["kind"] == "bench"
    assert report["backend"] == "sim" and report["quick"] is True
    # On Linux (glibc) the simulator's allocations keep freed blocks, as a device caching allocator does.
    if sys.platform.startswith("linux"):
        assert report["machine"]["host_allocator"].startswith("glibc mallopt M_MMAP_THRESHOLD=32 MiB")
    assert set(report["link"]) == {"h2d_gbps", "d2h_gbps", "duplex_gbps", "bytes"}
    assert all(report["link"][key] > 0 for key in report["link"])
    assert len(report["rows"]) == 2 * 4 and report["skipped"] == []
    for row in report["rows"]:
        assert set(row) == ROW_FIELDS
        assert row["plain_step_s"] > 0 and row["swapped_step_s"] > 0 and row["copies_alone_s"] > 0
        # The efficiency is the copy floor over the paired added time (None when swapping added nothing).
        # Never negative: where swapping added less than its copies alone, the copies were hidden (or noise won).
        if row["added_s"] >= row["copies_alone_s"]:
            expected = (row["added_s"] - row["copies_alone_s"]) / row["batches"]
            assert row["overhead_per_batch_s"] == pytest.approx(expected) and row["overhead_per_batch_s"] >= 0
        else:
            assert row["overhead_per_batch_s"] is None
        if row["added_s"] > 0:
            assert row["copy_floor_efficiency"] == pytest.approx(row["copy_floor_s"] / row["added_s"])
        else:
            assert row["copy_floor_efficiency"] is None


def test_every_measured_row_is_modeled_beside_it_with_the_same_bytes(report: dict[str, Any]) -> None:
    modeled = report["modeled_rows"]
    assert len(modeled) == len(report["rows"]) == 8
    for measured, model in zip(report["rows"], modeled, strict=True):
        assert (model["name"], model["swap_times"], model["packed"]) == (
            measured["workload"],
            measured["swap_times"],
            measured["packed"],
        )
        assert model["link"] == "pcie4" and model["ranks_per_node"] == 1  # the default --link, one rank per host
        # Meta tensors and the CPU simulator run the same pipeline: the same bytes and copies.
        for field in ("h2d_bytes", "d2h_bytes", "host_state_bytes", "host_pinned_bytes", "batches"):
            assert model[field] == measured[field], field
        assert model["copies"] == measured["h2d_copies"] + measured["d2h_copies"]
        assert model["device_peak_state_bytes"] == measured["peak_state_device_bytes_swapped"]
        assert model["plain_state_device_bytes"] == measured["peak_state_device_bytes_unswapped"]
        assert 0 < model["modeled_step_seconds"] <= model["modeled_transfer_seconds"]


def _rows(report: dict[str, Any], workload: str) -> list[dict[str, Any]]:
    return [row for row in report["rows"] if row["workload"] == workload]


def _uniform_copies(row: dict[str, Any], *, tensors: int) -> int:
    """Copies each way for equal tensors of one dtype: one per tensor, or packed one per batch, two with more than
    two batches (every balanced batch crosses the middle of its arena, where the copy is cut)."""
    if not row["packed"]:
        return tensors
    k = int(row["swap_times"])
    return k if k <= 2 else 2 * k


def test_exact_counts_many_small(report: dict[str, Any]) -> None:
    # 64 fp32 matrices of 32 x 32: one 4 KiB square_avg each, all swapped (min_numel 1024), no padding.
    for row in _rows(report, "many_small"):
        assert row["h2d_bytes"] == row["d2h_bytes"] == 64 * 4096
        assert row["peak_state_device_bytes_unswapped"] == 64 * 4096
        assert row["h2d_copies"] == row["d2h_copies"] == _uniform_copies(row, tensors=64)
        assert row["batches"] == row["swap_times"]
        # Two arenas of one balanced batch each: 2 x 64 x 4096 / k.
        staging = 2 * 64 * 4096 // row["swap_times"]
        assert row["peak_state_device_bytes_swapped"] == staging
        # Exact pinning: the packed buffer is 64 states of 4 KiB, each to the page; per tensor, each state to a page.
        assert row["host_state_bytes"] == 64 * 4096
        pinned = pinned_size(64 * 4096, "exact") if row["packed"] else 64 * pinned_size(4096, "exact")
        assert row["host_pinned_bytes"] == pinned


def test_exact_counts_mixed_dtypes(report: dict[str, Any]) -> None:
    # 8 bf16 then 8 fp32 matrices of 64 x 64: 8 KiB and 16 KiB states.
    for row in _rows(report, "mixed_bf16_fp32"):
        assert row["h2d_bytes"] == row["d2h_bytes"] == 8 * 8192 + 8 * 16384
        if not row["packed"]:
            assert row["h2d_copies"] == 16
        elif row["swap_times"] == 2:
            # Balanced by bytes: batch 0 = 8 bf16 + 2 fp32 (two dtypes), batch 1 = 6 fp32 (one dtype).
            assert row["h2d_copies"] == row["d2h_copies"] == 3


_FAULTS_PER_ROUND = """
import resource, statistics, sys, torch
from swap_bench.host_allocator import keep_freed_host_memory
if sys.argv[1] == "on":
    assert keep_freed_host_memory() is not None
def one_round():  # three 16 MiB temporaries at once, as an update makes them
    blocks = [torch.empty(4 * 2**20).fill_(1.0) for _ in range(3)]
    del blocks
for _ in range(3):  # the first rounds extend the heap (and move glibc's own thresholds)
    one_round()
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    one_round()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(statistics.median(faults), faults)
"""


def _median_faults_per_round(setting: str) -> tuple[float, str]:
    import os
    import subprocess

    # glibc's default threshold, fixed: without it glibc moves the threshold itself as blocks are freed,
    # so whether a plain process gives these blocks back differs from run to run.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    result = subprocess.run(
        [sys.executable, "-c", _FAULTS_PER_ROUND, setting],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=env,
    )
    median, rounds = result.stdout.split(" ", 1)
    return float(median), rounds


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_host_memory_is_kept_after_keep_freed_host_memory() -> None:
    """Freed 16 MiB blocks are reused without page faults once the setting is on (the reason it exists).

    Each run in a process of its own: the setting is process-wide, and how a block is reused depends
    on what the heap already holds (in the test process, whatever earlier tests left there). The
    median round decides, so that a round the kernel faults for its own reasons does not.
    """
    pages_per_round = 3 * (16 << 20) // mmap.PAGESIZE  # three 16 MiB blocks
    without, rounds_without = _median_faults_per_round("off")
    with_setting, rounds_with = _median_faults_per_round("on")
    # Served by mmap and unmapped when freed, every block faults all its pages in again (12,291 per round
    # here); with the setting they come from the heap, which keeps them, and no round faults.
    assert without > pages_per_round / 2, rounds_without
    assert with_setting < pages_per_round / 32, rounds_with


# -- comparison rows: plain AdamW against external offloading baselines -------------------------------------------

COMPARISON_FIELDS = {
    "workload", "optimizer", "baseline", "params", "steps", "plain_step_s", "baseline_step_s", "ratio",
    "bitwise_equal", "max_abs_diff",
}  # fmt: skip


def _sim_backend() -> DeviceBackend:
    return SimBackend(mode="sync", check_races=False, poison=False)


def _stand_in_adamw(params: list[torch.nn.Parameter], backend: DeviceBackend) -> BaselineOptimizer:
    """Plain torch AdamW in the baseline's place: on CPU tensors torch picks this same for-loop kernel by default."""
    return torch.optim.AdamW(params, foreach=False, **ADAMW_KWARGS)


def test_no_comparison_rows_without_adamw(report: dict[str, Any]) -> None:
    # The fixture benchmarks rmsprop only: comparisons are AdamW rows, so none is planned or skipped.
    assert report["comparisons"] == []


def test_comparison_rows_are_skipped_on_the_simulator(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    argv = ["--quick", "--backend", "sim", "--optimizers", "adamw", "--workloads", "many_small", "--json", str(path)]
    assert main(argv) == 0
    document = json.loads(path.read_text())
    assert document["schema"] == SCHEMA
    assert document["comparisons"] == []
    assert document["skipped"] == [
        {"row": "many_small adamw vs torchao", "reason": "needs a CUDA device (backend: sim)"},
        {"row": "many_small adamw vs deepspeed", "reason": "needs a CUDA device (backend: sim)"},
    ]
    assert len(document["rows"]) == 4  # the swapped AdamW rows still ran


def test_plan_comparisons_on_cuda() -> None:
    workloads = [QUICK_WORKLOADS["many_small"], QUICK_WORKLOADS["mixed_bf16_fp32"]]
    rows, skipped = plan_comparisons(
        workloads, ["torchao", "deepspeed"], backend_name="cuda", installed=lambda package: package == "deepspeed"
    )
    assert [row.label for row in rows] == ["many_small adamw vs deepspeed"]
    assert skipped == [
        {"row": "many_small adamw vs torchao", "reason": "torchao not installed"},
        {"row": "mixed_bf16_fp32 adamw vs torchao", "reason": "torchao not installed"},
        {
            "row": "mixed_bf16_fp32 adamw vs deepspeed",
            "reason": "deepspeed updates float32 parameters only; this workload has torch.bfloat16",
        },
    ]
    assert plan_comparisons(workloads, [], backend_name="cuda") == ([], [])


def test_comparison_row_with_a_stand_in_baseline() -> None:
    workload = QUICK_WORKLOADS["few_large"]
    result = measure_comparison(workload, "stand-in", _stand_in_adamw, _sim_backend, warmup=1, repeats=2)
    row = json.loads(json.dumps(result.as_dict(), allow_nan=False))
    assert set(row) == COMPARISON_FIELDS
    assert row["workload"] == "few_large" and row["optimizer"] == "adamw" and row["baseline"] == "stand-in"
    assert row["params"] == workload.numel and row["steps"] == 3
    assert row["plain_step_s"] > 0 and row["baseline_step_s"] > 0
    assert row["ratio"] == row["baseline_step_s"] / row["plain_step_s"]
    assert row["bitwise_equal"] is True and row["max_abs_diff"] == 0.0


def test_comparison_row_reports_a_difference() -> None:
    def other_lr(params: list[torch.nn.Parameter], backend: DeviceBackend) -> BaselineOptimizer:
        return torch.optim.AdamW(params, foreach=False, **{**ADAMW_KWARGS, "lr": 2e-3})

    result = measure_comparison(QUICK_WORKLOADS["few_large"], "other-lr", other_lr, _sim_backend, warmup=0, repeats=1)
    # One step moves each element by about lr (Adam's first step is lr * sign(grad)): 1e-3 more here.
    assert result.bitwise_equal is False
    assert result.max_abs_diff == pytest.approx(1e-3, rel=0.05)


def test_host_master_offload_matches_plain_adamw_on_the_checked_simulator() -> None:
    """The DeepSpeed row's step (grads to host, host AdamW on masters, masters back) with torch AdamW on the host.

    The simulator runs lazily (copy streams run only when forced) with poisoned fresh memory: stepping the host
    optimizer before the gradient copies are waited for, or not copying the masters back, gives wrong numbers.
    """

    def host_adamw(params: list[torch.nn.Parameter], backend: DeviceBackend) -> BaselineOptimizer:
        return HostMasterOffload(
            params, backend, lambda masters: torch.optim.AdamW(masters, foreach=False, **ADAMW_KWARGS)
        )

    result = measure_comparison(
        QUICK_WORKLOADS["many_small"], "host-adamw", host_adamw, lambda: SimBackend(mode="lazy"), warmup=1, repeats=2
    )
    assert result.bitwise_equal is True and result.steps == 3


def test_host_master_offload_takes_float32_only() -> None:
    backend = _sim_backend()
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match=r"float32 parameters only, got one of torch\.bfloat16"):
        HostMasterOffload(params, backend, lambda masters: torch.optim.AdamW(masters))


def test_run_bench_reports_comparisons_and_failed_baselines() -> None:
    def missing_package(params: list[torch.nn.Parameter], backend: DeviceBackend) -> BaselineOptimizer:
        raise ModuleNotFoundError("No module named 'torchao'")

    workload = QUICK_WORKLOADS["many_small"]
    comparisons = [
        ComparisonConfig(workload, Baseline("stand-in", "torch", _stand_in_adamw)),
        ComparisonConfig(workload, Baseline("broken", "torchao", missing_package)),
    ]
    console = Console(record=True, width=200)
    bench = run_bench(
        [],
        _sim_backend,
        backend_name="sim",
        backend_detail="test",
        quick=True,
        threads=1,
        warmup=1,
        repeats=1,
        console=console,
        comparisons=comparisons,
    )
    document = json.loads(json.dumps(bench.to_json(), allow_nan=False))
    assert document["schema"] == SCHEMA
    assert [row["baseline"] for row in document["comparisons"]] == ["stand-in"]
    assert set(document["comparisons"][0]) == COMPARISON_FIELDS
    assert document["skipped"] == [
        {"row": "many_small adamw vs broken", "reason": "failed: ModuleNotFoundError: No module named 'torchao'"}
    ]
    render_table(bench, console)
    assert "plain AdamW vs external offloading baselines" in console.export_text()


def test_sgd_rows_through_swap_generic_or_skipped_naming_it(tmp_path: Path) -> None:
    """SGD (momentum) is served by swap-generic: exact counts when it is installed, a named skip when not."""
    path = tmp_path / "bench.json"
    argv = ["--quick", "--backend", "sim", "--optimizers", "sgd", "--workloads", "many_small", "--json", str(path)]
    assert main(argv) == 0
    document = json.loads(path.read_text())
    if importlib.util.find_spec("swap_generic") is None:
        assert document["rows"] == [] and len(document["skipped"]) == 4
        assert all("--find-links dist swap-core swap-generic" in skipped["reason"] for skipped in document["skipped"])
        return
    assert len(document["rows"]) == 4 and document["skipped"] == []
    for row in document["rows"]:
        # 64 fp32 matrices of 32 x 32: one 4 KiB momentum_buffer each, created by SGD's first step, then swapped.
        assert row["h2d_bytes"] == row["d2h_bytes"] == row["host_state_bytes"] == 64 * 4096
        assert row["h2d_copies"] == row["d2h_copies"] == _uniform_copies(row, tensors=64)
        assert row["batches"] == row["swap_times"]
    # Modeled over meta tensors, SGD's own step creates the same momentum buffers (swap-generic's probe of the
    # step runs on CPU stand-ins, since meta tensors hold no values to compare).
    assert [row["h2d_bytes"] for row in document["modeled_rows"]] == [row["h2d_bytes"] for row in document["rows"]]
