"""``swap-bench device-perf`` on the simulator: its rows, sizing, facts, budget and report; never its timings.

What tools/device-perf.sh measures on a GPU is checked here for what does not depend on the device: the decoder has
the planner's parameters, the sizing follows its rules, each swapped row moves exactly the bytes of the fp32 masters
and moments and ends bitwise the plain optimizer, the link utilization is the measured rate over the raw one, a row
that fails or outlasts the budget is reported and the others run, and the JSON report has the documented shape.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from swap_bench import device_perf, perf_rows
from swap_bench.decoder import Decoder, token_batch
from swap_bench.device_facts import device_facts
from swap_bench.device_perf import (
    MAX_ROW_S,
    MIN_ROW_S,
    PERF_MODELS,
    ROWS,
    RowOutcome,
    device_perf_main,
    run_in_own_process,
)
from swap_bench.link import LinkBandwidth
from swap_bench.models import MODELS, ModelShape
from swap_bench.perf_sizing import (
    ACTIVATION_SHARE,
    fitted_shape,
    plan_tokens,
    row_device_bytes,
    transfer_seconds,
)
from swap_bench.report import SCHEMA
from swap_core.master_weights.remainder import remainder_nbytes

pytestmark = pytest.mark.sim_only

TINY = PERF_MODELS["tiny"].shape
ROW_FIELDS = {
    "name", "optimizer", "tokens", "sequences", "params", "plain_iteration_s", "iteration_s", "ratio", "added_s",
    "backward_s", "plain_state_device_bytes", "bitwise_equal", "max_abs_diff", "swap_times", "link_bytes_per_second",
    "link_fraction_of_raw", "h2d_bytes", "d2h_bytes", "h2d_copies", "d2h_copies", "batches", "batches_in_backward",
    "peak_state_device_bytes", "host_pinned_bytes",
}  # fmt: skip


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_decoder_has_the_planners_parameters_and_trains(tied: bool) -> None:
    shape = dataclasses.replace(TINY, tie_word_embeddings=tied)
    model = Decoder(shape).to(torch.bfloat16)
    assert [(name, tuple(param.shape)) for name, param in model.named_parameters()] == shape.parameter_shapes()
    loss = model(token_batch(shape.vocab_size, 2, 16, torch.device("cpu")))
    assert loss.dtype == torch.bfloat16 and torch.isfinite(loss)
    loss.backward()
    assert all(param.grad is not None and param.grad.abs().sum() > 0 for param in model.parameters())


def test_the_device_model_is_llama_1b_with_a_32k_vocabulary() -> None:
    shape = PERF_MODELS["1b"].shape
    assert dataclasses.replace(shape, name="llama-1b", vocab_size=128256) == MODELS["llama-1b"]
    assert shape.numel == 1_038_682_112  # 1.236B less the 96,256 dropped rows of the tied 2,048-wide embedding


def test_the_rows_process_holds_both_models_the_plain_optimizer_and_two_arenas() -> None:
    # 20 bytes a parameter for the plain model and its optimizer, 4 for the other model, two arenas of 12 x P / k.
    assert row_device_bytes(1000, 4) == 1000 * 24 + 2 * 3000


def test_a_model_is_fitted_to_half_the_free_memory_by_its_layers() -> None:
    shape = PERF_MODELS["1b"].shape
    ten_layers = dataclasses.replace(shape, num_hidden_layers=10)
    free = 2 * row_device_bytes(ten_layers.numel, 16)
    assert fitted_shape(shape, free, 16) == ten_layers
    assert fitted_shape(shape, free - 2, 16).num_hidden_layers == 9
    assert fitted_shape(shape, 100 * free, 16) == shape
    with pytest.raises(ValueError, match=r"does not fit in 0.10 GB of free device memory even with one layer"):
        fitted_shape(shape, 10**8, 16)


def test_the_transfers_take_the_slowest_of_each_way_and_both_at_once() -> None:
    params = 10**6
    swapped = 12 * params
    link = LinkBandwidth(h2d=10e9, d2h=5e9, duplex=12e9, nbytes=1)
    assert transfer_seconds(params, link) == swapped / 5e9
    fast_each_way = LinkBandwidth(h2d=10e9, d2h=10e9, duplex=12e9, nbytes=1)
    assert transfer_seconds(params, fast_each_way) == 2 * swapped / 12e9


def test_the_long_rows_hide_the_transfers_and_the_short_one_cannot() -> None:
    sizes = {"transfer_s": 1.0, "backward_s_per_token": 1e-4, "seq_len": 100, "max_tokens": 10**6}
    # 1.5 s of backward is 15,000 tokens; 0.25 s is 2,500 (a quarter of the long rows' at most).
    assert plan_tokens(**sizes, activation_bytes_per_token=0.0, spare_bytes=0) == (15_000, 2_500)
    # Activations of 1 MB a token in 5 GB spare: 4,000 tokens fit; the short row then gets a quarter of them.
    assert int(ACTIVATION_SHARE * 5e9 / 1e6) == 4_000
    assert plan_tokens(**sizes, activation_bytes_per_token=1e6, spare_bytes=5 * 10**9) == (4_000, 1_000)
    # Never less than one sequence, never more than max_tokens.
    assert plan_tokens(**{**sizes, "max_tokens": 50}, activation_bytes_per_token=0.0, spare_bytes=0) == (100, 100)
    assert plan_tokens(**{**sizes, "max_tokens": 1_000}, activation_bytes_per_token=0.0, spare_bytes=0) == (1_000, 200)


def test_the_machines_facts_are_read_from_nvidia_smi_and_sysfs(tmp_path: Path) -> None:
    answers = {
        "--query-gpu=name": "NVIDIA H100 80GB HBM3",
        "--query-gpu=driver_version": "580.159.04",
        "--query-gpu=memory.total": "81559",
        "--query-gpu=pci.bus_id": "00000000:18:00.0",
        "--query-gpu=pcie.link.gen.current": "5",
        "--query-gpu=pcie.link.gen.max": "5",
        "--query-gpu=pcie.link.width.current": "16",
        "--query-gpu=pcie.link.width.max": "16",
    }
    asked: list[list[str]] = []

    def nvidia_smi(command: Any) -> str | None:
        asked.append(list(command))
        if len(command) == 1:
            return "| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0 |"
        if command[1:] == ["c2c", "-s"]:
            return "Device does not support C2C"
        return answers.get(command[1]) if len(command) > 1 else None

    device = tmp_path / "bus" / "pci" / "devices" / "0000:18:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("1\n")
    for node in ("node0", "node1", "nodes_online"):
        (tmp_path / "devices" / "system" / "node" / node).mkdir(parents=True)
    facts = device_facts("cuda", run=nvidia_smi, sysfs=tmp_path, smi="nvidia-smi")
    assert facts["gpu"] == "NVIDIA H100 80GB HBM3" and facts["driver"] == "580.159.04"
    assert facts["driver_cuda"] == "13.0" and facts["nvlink_c2c"] is None
    assert facts["link"] == "PCIe 5.0 x16 (at most 5.0 x16)"
    assert facts["gpu_numa_node"] == 1 and facts["numa_nodes"] == 2
    assert facts["torch"] == torch.__version__ and facts["backend"] == "cuda"
    assert ["nvidia-smi", "topo", "-m"] in asked


def test_without_nvidia_smi_the_device_facts_are_none(tmp_path: Path) -> None:
    facts = device_facts("sim", run=lambda _: None, sysfs=tmp_path)
    for key in ("gpu", "driver", "pcie_generation", "link", "gpu_numa_node"):
        assert facts[key] is None, key


def _in_process(request: dict[str, Any], limit_s: float) -> RowOutcome:
    """A row run by :func:`swap_bench.perf_rows.main` in this process, through the same request and result files."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        request_path, result_path = Path(folder) / "request.json", Path(folder) / "result.json"
        request_path.write_text(json.dumps(request))
        assert perf_rows.main([str(request_path), str(result_path)]) == 0
        result = json.loads(result_path.read_text())
    return RowOutcome(time.monotonic() - started, result=result)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The dry run's report, its rows measured in this process (``run_in_own_process`` tested on its own below)."""
    path = tmp_path_factory.mktemp("device-perf") / "device-perf.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(device_perf, "run_in_own_process", _in_process)
        assert device_perf_main(["--backend", "sim", "--check-parity", "--json", str(path)]) == 0
    document: dict[str, Any] = json.loads(path.read_text())
    yield document


def test_the_report_has_every_kind_of_swap_bench_report_and_its_device_perf_rows(report: dict[str, Any]) -> None:
    assert report["schema"] == SCHEMA == "swap-bench/9" and report["kind"] == "device-perf"
    for empty in ("rows", "comparisons", "modeled_rows", "narrowing_rows", "iteration_rows"):
        assert report[empty] == [], empty
    assert report["backend"] == "sim" and report["failed"] == []
    assert report["skipped"] == [{"row": "torchao, long", "reason": "needs a CUDA device (backend: sim)"}]
    assert report["machine"]["threads"] == 1 and "gpu_numa_node" in report["machine"]
    assert [row["name"] for row in report["device_perf_rows"]] == [row.name for row in ROWS[1:4]]
    assert set(report["row_seconds"]) == {row.name for row in ROWS[:4]}
    assert report["settings"]["shape"]["name"] == "tiny" and report["settings"]["budget_s"] == 400
    plan = report["plan"]
    assert plan["params"] == TINY.numel and plan["free_device_bytes"] == 2**30
    assert plan["tokens_short"] <= plan["tokens_long"] and plan["tokens_long"] % 16 == 0
    assert report["link"]["duplex_gbps"] == plan["link"]["duplex"] / 1e9


def test_each_swapped_row_moves_the_masters_and_moments_and_ends_bitwise_plain(report: dict[str, Any]) -> None:
    swapped = [param.numel() for param in Decoder(TINY).parameters() if param.numel() >= 1024]
    duplex = report["plan"]["link"]["duplex"]
    for row in report["device_perf_rows"]:
        assert set(row) == ROW_FIELDS
        # 2 fp32 moments and the master: fp32 inside the backward, the bits the bf16 parameter lacks after it.
        inside = row["optimizer"] == "in_backward"
        moved = sum(8 * numel + (4 * numel if inside else remainder_nbytes(numel)) for numel in swapped)
        assert row["h2d_bytes"] == row["d2h_bytes"] == moved, row["name"]
        assert row["batches"] == row["swap_times"] == 4 and row["h2d_copies"] == row["d2h_copies"]
        assert row["batches_in_backward"] == (4 if row["optimizer"] == "in_backward" else 0)
        assert row["bitwise_equal"] is True and row["max_abs_diff"] == 0.0
        assert row["link_bytes_per_second"] > 0
        assert row["link_fraction_of_raw"] == row["link_bytes_per_second"] / duplex
        assert row["ratio"] == row["iteration_s"] / row["plain_iteration_s"]
        assert row["plain_state_device_bytes"] == 16 * TINY.numel  # masters, their gradients, two moments
    short = report["device_perf_rows"][2]
    assert short["tokens"] == report["plan"]["tokens_short"]


def test_the_goals_are_reported_never_asserted(report: dict[str, Any]) -> None:
    goals = {goal["goal"]: goal for goal in report["goals"]}
    assert len(goals) == 3
    inside = report["device_perf_rows"][1]
    ratio_goal = goals["the in-backward iteration within 1.05 x of plain (long tokens)"]
    assert ratio_goal["value"] == inside["ratio"] and ratio_goal["met"] == (inside["ratio"] <= 1.05)
    after = report["device_perf_rows"][0]
    link_goal = goals["the after-backward step's copies at 0.9 or more of the raw rate both ways at once"]
    assert link_goal["value"] == after["link_fraction_of_raw"] and link_goal["met"] == (link_goal["value"] >= 0.9)
    torchao_goal = goals["the in-backward iteration faster than torchao's CPUOffloadOptimizer's (long tokens)"]
    assert torchao_goal["value"] is None and torchao_goal["met"] is None  # skipped on the simulator


def _settings() -> perf_rows.PerfSettings:
    return device_perf._settings(device_perf.device_perf_parser().parse_args(["--backend", "sim"]), "sim")


def _report(budget_s: float) -> device_perf.DevicePerfReport:
    return device_perf.DevicePerfReport("sim", "SimBackend", {}, _settings(), budget_s)


def test_a_row_without_its_share_of_the_budget_is_not_run_and_the_rest_wait_for_a_plan() -> None:
    ran: list[str] = []

    def never(request: dict[str, Any], limit_s: float) -> RowOutcome:
        ran.append(request["name"])
        raise AssertionError("no row has the time to run")

    report = _report(budget_s=3 * MIN_ROW_S)  # the plan would leave the 3 rows after it under 20 s each
    device_perf.run_rows(_settings(), "sim", report, console=device_perf.Console(quiet=True), run_row=never)
    assert ran == []
    assert report.failed[0] == {"row": "plan", "reason": "not run: the 60 s budget is spent"}
    assert [failed["reason"] for failed in report.failed[1:]] == ["not run: the plan row gave no plan"] * 3


def test_a_failed_row_is_reported_and_the_next_one_runs(capsys: pytest.CaptureFixture[str]) -> None:
    limits: dict[str, float] = {}

    def runner(request: dict[str, Any], limit_s: float) -> RowOutcome:
        limits[request["name"]] = limit_s
        if request["name"] == "after_backward, long":
            return RowOutcome(1.0, failure="exit status 1: torch.OutOfMemoryError: CUDA out of memory", output_tail="…")
        return _in_process(request, limit_s)

    report = _report(budget_s=400)
    saved: list[list[str]] = []

    def save(so_far: device_perf.DevicePerfReport) -> None:
        saved.append([row["name"] for row in so_far.rows] + [failed["row"] for failed in so_far.failed])

    device_perf.run_rows(_settings(), "sim", report, console=device_perf.Console(), run_row=runner, after_row=save)
    assert report.failed == [
        {
            "row": "after_backward, long",
            "reason": "exit status 1: torch.OutOfMemoryError: CUDA out of memory",
            "output_tail": "…",
        }
    ]
    assert [row["name"] for row in report.rows] == ["in_backward, long", "in_backward, short"]
    # Each row may take what is left, less 20 s for each row still to run after it, and 180 s at most.
    assert limits["plan"] == MAX_ROW_S < 400 - 3 * MIN_ROW_S and max(limits.values()) <= MAX_ROW_S
    # The report is saved after each row that ran: a run cut short keeps what it measured.
    assert saved == [
        [],
        ["after_backward, long"],
        ["in_backward, long", "after_backward, long"],
        ["in_backward, long", "in_backward, short", "after_backward, long"],
    ]
    assert "after_backward, long failed" in capsys.readouterr().out


def test_parity_checked_rows_that_differ_fail_the_dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def differing(request: dict[str, Any], limit_s: float) -> RowOutcome:
        outcome = _in_process(request, limit_s)
        if outcome.result is not None and "row" in outcome.result:
            outcome.result["row"]["bitwise_equal"] = False
        return outcome

    monkeypatch.setattr(device_perf, "run_in_own_process", differing)
    argv = ["--backend", "sim", "--repeats", "1", "--json", str(tmp_path / "report.json")]
    assert device_perf_main(argv) == 0  # reported, not checked
    assert device_perf_main([*argv, "--check-parity"]) == 1


def test_a_rows_own_process_reports_its_error_and_its_time_limit(tmp_path: Path) -> None:
    broken = run_in_own_process({"kind": "plan", "backend": "sim"}, limit_s=120)  # no settings
    assert broken.result is None and broken.failure == "exit status 1: KeyError: 'settings'"
    assert "Traceback" in broken.output_tail
    stuck = run_in_own_process({"kind": "plan", "backend": "sim"}, limit_s=0.01)
    assert stuck.failure == "timed out after 0 s" and stuck.result is None


def test_the_tiny_model_is_the_simulators_and_the_1b_model_a_devices() -> None:
    parser = device_perf.device_perf_parser()
    on_sim = device_perf._settings(parser.parse_args([]), "sim")
    assert on_sim.shape == TINY and on_sim.device_memory == 2**30 and on_sim.threads == 1 and on_sim.repeats == 2
    on_cuda = device_perf._settings(parser.parse_args(["--swap-times", "8"]), "cuda")
    assert on_cuda.shape == PERF_MODELS["1b"].shape and on_cuda.swap_times == 8 and on_cuda.device_memory is None
    assert on_cuda.threads is None and on_cuda.repeats == 5 and on_cuda.seq_len == 2048
    assert isinstance(on_cuda.shape, ModelShape)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is not None, reason="checks the row of a machine without it")
def test_a_torchao_row_that_cannot_import_torchao_is_skipped_with_the_reason(report: dict[str, Any]) -> None:
    request = {
        "kind": "torchao",
        "name": "torchao, long",
        "backend": "sim",
        "settings": _settings().to_json(),
        "plan": report["plan"],
        "tokens": report["plan"]["tokens_long"],
    }
    outcome = _in_process(request, limit_s=120)
    assert outcome.result == {"skipped": "torchao could not be imported: No module named 'torchao'"}
