"""swap-bench --quick as a CI smoke test: the JSON schema and exact byte/copy counts, never timings."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from swap_core.bench import main
from swap_core.bench.report import SCHEMA

pytestmark = pytest.mark.sim_only

ROW_FIELDS = {
    "workload", "optimizer", "swap_times", "packed", "duplex", "params", "plain_step_s", "swapped_step_s", "ratio",
    "swapped_state_bytes", "h2d_bytes", "d2h_bytes", "h2d_copies", "d2h_copies", "batches", "achieved_gbps",
    "copy_floor_s", "copy_floor_efficiency", "ideal_step_s", "ideal_percent", "peak_state_device_bytes_swapped",
    "peak_state_device_bytes_unswapped",
}  # fmt: skip


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = ["--quick", "--backend", "sim", "--optimizers", "rmsprop", "--workloads", "many_small", "mixed_bf16_fp32"]
    assert main([*argv, "--json", str(path)]) == 0
    document: dict[str, Any] = json.loads(Path(path).read_text())
    return document


def test_schema(report: dict[str, Any]) -> None:
    assert report["schema"] == SCHEMA
    assert report["backend"] == "sim" and report["quick"] is True
    # On Linux (glibc) the simulator's allocations keep freed blocks, as a device caching allocator does.
    if sys.platform.startswith("linux"):
        assert report["machine"]["host_allocator"].startswith("glibc mallopt M_MMAP_THRESHOLD=32 MiB")
    assert set(report["link"]) == {"h2d_gbps", "d2h_gbps", "duplex_gbps", "bytes"}
    assert all(report["link"][key] > 0 for key in report["link"])
    assert len(report["rows"]) == 2 * 4 and report["skipped"] == []
    for row in report["rows"]:
        assert set(row) == ROW_FIELDS
        assert row["plain_step_s"] > 0 and row["swapped_step_s"] > 0


def _rows(report: dict[str, Any], workload: str) -> list[dict[str, Any]]:
    return [row for row in report["rows"] if row["workload"] == workload]


def test_exact_counts_many_small(report: dict[str, Any]) -> None:
    # 64 fp32 matrices of 32 x 32: one 4 KiB square_avg each, all swapped (min_numel 1024), no padding.
    for row in _rows(report, "many_small"):
        assert row["h2d_bytes"] == row["d2h_bytes"] == 64 * 4096
        assert row["peak_state_device_bytes_unswapped"] == 64 * 4096
        expected_copies = row["swap_times"] if row["packed"] else 64
        assert row["h2d_copies"] == row["d2h_copies"] == expected_copies
        assert row["batches"] == row["swap_times"]
        # Two arenas of one balanced batch each: 2 x 64 x 4096 / k.
        staging = 2 * 64 * 4096 // row["swap_times"]
        assert row["peak_state_device_bytes_swapped"] == staging


def test_exact_counts_mixed_dtypes(report: dict[str, Any]) -> None:
    # 8 bf16 then 8 fp32 matrices of 64 x 64: 8 KiB and 16 KiB states.
    for row in _rows(report, "mixed_bf16_fp32"):
        assert row["h2d_bytes"] == row["d2h_bytes"] == 8 * 8192 + 8 * 16384
        if not row["packed"]:
            assert row["h2d_copies"] == 16
        elif row["swap_times"] == 2:
            # Balanced by bytes: batch 0 = 8 bf16 + 2 fp32 (two dtypes), batch 1 = 6 fp32 (one dtype).
            assert row["h2d_copies"] == row["d2h_copies"] == 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_host_memory_is_kept_after_keep_freed_host_memory() -> None:
    """A freed 16 MiB block is reused without page faults once the setting is on (the reason it exists)."""
    import resource

    import torch

    from swap_core.bench.host_allocator import keep_freed_host_memory

    assert keep_freed_host_memory() is not None
    for _ in range(2):  # the first block after the switch extends the heap; later ones reuse it
        torch.empty(4 * 2**20).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.empty(4 * 2**20).fill_(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # Without the setting each round faults its 4096 pages in again (about 16,000 here).
    assert faults < 1024, faults
