"""The planner's figures quoted in README.md and docs/benchmarks.md are what the planner gives today, and the
exact columns (bytes, copies, peaks) of README.md's measured table are what a step gives today.

Modeled on the virtual clock, so deterministic: a change of the pipeline, the link presets or the models that
moves a documented figure fails here, naming the figure and the text to write instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from swap_bench.measure import optimizer_state_bytes
from swap_bench.models import MODELS
from swap_bench.planner import markdown_table, plan_model, recommend
from swap_bench.workloads import OPTIMIZERS, WORKLOADS
from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend

pytestmark = [pytest.mark.sim_only, pytest.mark.figures]

ROOT = Path(__file__).resolve().parents[3]


def _text(relative: str) -> str:
    """The file's text with every run of whitespace made one space (figures wrap across lines)."""
    return re.sub(r"\s+", " ", (ROOT / relative).read_text())


def _assert_quoted(relative: str, expected: str) -> None:
    assert re.sub(r"\s+", " ", expected) in _text(relative), f"{relative} should say: {expected!r}"


@pytest.mark.parametrize("master_weights", [False, True], ids=["fp32", "masters"])
def test_the_planner_tables_rows_on_pcie4(master_weights: bool) -> None:
    for name in ("llama-1b", "llama-7b", "llama-70b"):
        row = plan_model(MODELS[name], "adamw", world=8, link="pcie4", swap_times=4, master_weights=master_weights)
        line = markdown_table([row]).splitlines()[-1]
        _assert_quoted("docs/benchmarks.md", line)


def test_the_llama_70b_figures_of_the_readme_and_the_benchmarks_page() -> None:
    k4 = plan_model(MODELS["llama-70b"], "adamw", world=8, link="pcie4", swap_times=4, master_weights=True)
    k16 = plan_model(MODELS["llama-70b"], "adamw", world=8, link="pcie4", swap_times=16, master_weights=True)
    _assert_quoted(
        "README.md",
        f"their masters and moments take {k4.plain_state_device_bytes / 1e9:.2f} GB of device memory; swapped, none "
        f"between steps and a {k4.device_peak_state_bytes / 1e9:.2f} GB peak during the step "
        f"({k16.device_peak_state_bytes / 1e9:.2f} GB at `swap_times=16`), {k4.host_state_bytes / 1e9:.2f} GB of "
        f"pinned host memory, and a cold step's transfers take {k4.modeled_transfer_seconds:.3f} s of modeled time "
        f"against a {k4.bound_seconds:.3f} s pipeline bound",
    )
    _assert_quoted(
        "docs/benchmarks.md",
        f"k = 4 peaks at {k4.device_peak_state_bytes / 1e9:.2f} GB on the device, k = 16 at "
        f"{k16.device_peak_state_bytes / 1e9:.2f} GB ({k16.copies} copies), with a modeled transfer of "
        f"{k16.modeled_transfer_seconds:.3f} s against a bound of {k16.bound_seconds:.3f} s "
        f"({k16.modeled_transfer_seconds / k16.bound_seconds:.3f} x;",
    )


def test_the_device_memory_table() -> None:
    for name in ("llama-7b", "llama-70b"):
        chosen, neighbours = recommend(MODELS[name], "adamw", device_memory=8 * 10**9, world=8, link="pcie5")
        for row in (chosen, *neighbours):
            _assert_quoted(
                "docs/benchmarks.md",
                f"| {name} | {row.batches_label} | {row.device_peak_state_bytes / 1e9:.2f} | {row.copies} "
                f"| {row.modeled_step_seconds:.4f} | {row.modeled_transfer_seconds:.4f} | {row.bound_seconds:.4f} |",
            )


_README_ROW = re.compile(
    r"^\| (?P<workload>\w+) \| (?P<k>\d+) \| (?P<layout>packed|per-tensor|packed, 1 stream) \|(?:[^|]*\|){7}"
    r" (?P<mb>\d+) \| (?P<copies>\d+\+\d+) \| (?P<swapped>[\d.]+) / (?P<plain>[\d.]+) \|$",
    re.MULTILINE,
)


def _readme_rows() -> list[dict[str, str]]:
    return [match.groupdict() for match in _README_ROW.finditer((ROOT / "README.md").read_text())]


def test_the_readme_benchmark_table_is_read_whole() -> None:
    rows = _readme_rows()
    assert len(rows) == 24 and {row["workload"] for row in rows} == set(WORKLOADS), rows


@pytest.mark.parametrize("row", _readme_rows(), ids=lambda row: f"{row['workload']}-k{row['k']}-{row['layout']}")
def test_the_readme_benchmark_tables_exact_columns(row: dict[str, str]) -> None:
    """The bytes, copies and peaks of README.md's measured AdamW table are exact: the same step on the simulator
    gives them again (the timings are measurements, and are not checked)."""
    workload, adamw = WORKLOADS[row["workload"]], OPTIMIZERS["adamw"]
    sim = SimBackend(mode="sync", check_races=False, poison=False)
    params, plain_params = workload.make_params(sim.device), workload.make_params(sim.device)
    for param, plain_param, grad in zip(params, plain_params, workload.make_grads(params), strict=True):
        param.grad, plain_param.grad = grad.clone(), grad.clone()
    config = SwapConfig(
        backend=sim,
        swap_times=int(row["k"]),
        packed=row["layout"] != "per-tensor",
        duplex="1 stream" not in row["layout"],
    )
    swapped, plain = swap_optimizer(adamw.build(params), config), adamw.build(plain_params)
    for _ in range(2):  # as the benchmark's warm-up: the second step is a steady one
        swapped.step()
        plain.step()
    stats = swapped.stats
    assert f"{(stats.h2d_bytes + stats.d2h_bytes) / 2**20:.0f}" == row["mb"]
    assert f"{stats.h2d_copies}+{stats.d2h_copies}" == row["copies"]
    assert f"{stats.peak_state_device_bytes / 2**20:.1f}" == row["swapped"]
    assert f"{optimizer_state_bytes(plain) / 2**20:.1f}" == row["plain"]
