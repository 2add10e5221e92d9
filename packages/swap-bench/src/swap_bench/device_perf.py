"""``swap-bench device-perf``: a training iteration with swapped AdamW against plain AdamW and against torchao's
CPU-offloaded AdamW on one device, and the link bandwidth the swapped steps achieve, within a time budget.

Rows (:data:`ROWS`), each in a process of its own (:mod:`swap_bench.perf_rows`), one after the other:

- ``plan``: raw pinned copies host-to-device, device-to-host and both at once; the model fitted to the device's free
  memory; the tokens of the long rows (a backward long enough to hide a step's copies) and of the short row (one too
  short to) from a forward and backward timed at a probe size (:mod:`swap_bench.perf_sizing`);
- ``after_backward, long`` and ``in_backward, long``: AdamW over fp32 masters swapped with ``SwapConfig(
  master_weights=True)``, stepping after the backward or inside it, against the same AdamW over masters on the device,
  alternated iteration by iteration; ``in_backward, short`` the same with the short tokens;
- ``torchao, long``: torchao's ``CPUOffloadOptimizer`` (a CUDA device and torchao needed, else a skipped row) against
  the same plain optimizer.

Each swapped row reports the link bytes per second its steps achieved (``opt.stats.link_bytes_per_second``, traced
steps) against the raw rate of copies both ways at once. The JSON report (schema ``swap-bench/9``, kind
``"device-perf"``) holds the machine's facts, the plan, every row, the skipped and failed ones and the goals; a table
is printed. A row that fails or runs out of the budget is reported and the next one runs; the exit status is 1 when
one failed (or, with ``--check-parity``, when a swapped row's parameters are not bitwise the plain ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from swap_core.config import BACKEND_NAMES

from .arguments import byte_size, command_parser, count, output_file, positive_count
from .bench_backend import bench_backend, refuse_a_missing_accelerator
from .comparisons import plan_comparisons
from .device_facts import device_facts
from .models import MODELS, ModelShape
from .perf_rows import PerfSettings, TrainingPlan
from .report import SCHEMA, print_skipped, readable_bytes, readable_seconds, save_json
from .workloads import Workload

__all__ = [
    "PERF_MODELS",
    "ROWS",
    "DevicePerfReport",
    "PerfModel",
    "PerfRow",
    "RowOutcome",
    "device_perf_main",
    "device_perf_parser",
    "run_in_own_process",
    "run_rows",
]


@dataclasses.dataclass(frozen=True)
class PerfModel:
    """A model to run and the sizes that go with it."""

    shape: ModelShape
    seq_len: int
    probe_tokens: int
    max_tokens: int
    swap_times: int
    link_bytes: int
    """Bytes of each raw pinned copy."""


PERF_MODELS: dict[str, PerfModel] = {
    # Llama 3.2 1B with a 32,000-token vocabulary (1.04B parameters): its logits fit beside many tokens.
    "1b": PerfModel(
        dataclasses.replace(MODELS["llama-1b"], name="llama-1b-32k-vocab", vocab_size=32000),
        seq_len=2048,
        probe_tokens=8192,
        max_tokens=131072,
        swap_times=16,
        link_bytes=256 * 2**20,
    ),
    "tiny": PerfModel(
        ModelShape("tiny", 64, 128, 2, 4, 2, 256, tie_word_embeddings=True),
        seq_len=16,
        probe_tokens=64,
        max_tokens=128,
        swap_times=4,
        link_bytes=8 * 2**20,
    ),
}
"""``--model``: ``1b`` on a device, ``tiny`` for the dry run on the simulator."""

SIM_DEVICE_MEMORY = 2**30
"""The free memory the dry run sizes for on the simulator (which has no capacity of its own)."""
MIN_ROW_S = 20
"""Seconds each row still to run is guaranteed out of the budget; a row left with less is not run."""
MAX_ROW_S = 180
"""The most one row may take (about 40 s expected on a GPU; torchao's host AdamW is the slowest): a hung row does not
eat the budget of the rows after it."""
LINK_GOAL = 0.9
RATIO_GOAL = 1.05


@dataclasses.dataclass(frozen=True)
class PerfRow:
    """A row: ``kind`` is ``"plan"`` or one of :data:`~swap_bench.perf_rows.ROW_KINDS`; ``tokens`` the plan's long
    or short token count."""

    kind: str
    tokens: str | None = None

    @property
    def name(self) -> str:
        return self.kind if self.tokens is None else f"{self.kind}, {self.tokens}"


ROWS = (
    PerfRow("plan"),
    PerfRow("after_backward", "long"),
    PerfRow("in_backward", "long"),
    PerfRow("in_backward", "short"),
    PerfRow("torchao", "long"),
)


@dataclasses.dataclass(frozen=True)
class RowOutcome:
    """What a row's process gave: its result document, or why it failed and the end of its output."""

    seconds: float
    result: dict[str, Any] | None = None
    failure: str | None = None
    output_tail: str = ""


RowRunner = Callable[[dict[str, Any], float], RowOutcome]
"""Runs one row's request within a time limit (seconds)."""


@dataclasses.dataclass
class DevicePerfReport:
    """Everything one run reports: the machine, the settings, the plan, the rows, and the rows skipped or failed."""

    backend: str
    backend_detail: str
    machine: dict[str, Any]
    settings: PerfSettings
    budget_s: float
    plan: TrainingPlan | None = None
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)
    failed: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    row_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def goals(self) -> list[dict[str, Any]]:
        """Issue 47's goals, reported against the rows (never asserted): ``met`` is ``None`` where unmeasured.

        The link goal is read on the step after the backward, whose copies run back to back; inside a backward
        long enough to hide them they wait for the gradients, and their window is the backward's."""
        by_name = {row["name"]: row for row in self.rows}
        after, inside = by_name.get("after_backward, long"), by_name.get("in_backward, long")
        torchao = by_name.get("torchao, long")
        fraction = None if after is None else after["link_fraction_of_raw"]
        return [
            _goal(
                f"the after-backward step's copies at {LINK_GOAL} or more of the raw rate both ways at once",
                fraction,
                None if fraction is None else fraction >= LINK_GOAL,
                "of the raw rate",
            ),
            _goal(
                f"the in-backward iteration within {RATIO_GOAL} x of plain (long tokens)",
                None if inside is None else inside["ratio"],
                None if inside is None else inside["ratio"] <= RATIO_GOAL,
                "x",
            ),
            _goal(
                "the in-backward iteration faster than torchao's CPUOffloadOptimizer's (long tokens)",
                None if inside is None or torchao is None else inside["iteration_s"] / torchao["iteration_s"],
                None if inside is None or torchao is None else inside["iteration_s"] < torchao["iteration_s"],
                "x of torchao's",
            ),
        ]

    def to_json(self) -> dict[str, Any]:
        link = None if self.plan is None else self.plan.link
        return {
            "schema": SCHEMA,
            "kind": "device-perf",
            "machine": self.machine,
            "backend": self.backend,
            "backend_detail": self.backend_detail,
            "settings": {**self.settings.to_json(), "budget_s": self.budget_s},
            "plan": None if self.plan is None else self.plan.to_json(),
            "link": None
            if link is None
            else {
                "h2d_gbps": link.h2d / 1e9,
                "d2h_gbps": link.d2h / 1e9,
                "duplex_gbps": link.duplex / 1e9,
                "bytes": link.nbytes,
            },
            "rows": [],
            "skipped": self.skipped,
            "failed": self.failed,
            "comparisons": [],
            "modeled_rows": [],
            "narrowing_rows": [],
            "iteration_rows": [],
            "device_perf_rows": self.rows,
            "goals": self.goals(),
            "row_seconds": self.row_seconds,
            "seconds": self.seconds,
        }


def _goal(text: str, value: float | None, met: bool | None, unit: str) -> dict[str, Any]:
    return {"goal": text, "value": value, "unit": unit, "met": met}


def run_rows(
    settings: PerfSettings,
    backend: str,
    report: DevicePerfReport,
    *,
    console: Console,
    run_row: RowRunner | None = None,
    after_row: Callable[[DevicePerfReport], object] | None = None,
) -> None:
    """Every row of :data:`ROWS` in turn into ``report``, each within what is left of ``report.budget_s`` less
    :data:`MIN_ROW_S` for each row after it, and :data:`MAX_ROW_S` at most; ``run_row`` runs one (default:
    :func:`run_in_own_process`), ``after_row`` is called after each (the report saved so far)."""
    runner = run_row or run_in_own_process
    started = time.monotonic()
    deadline = started + report.budget_s
    planned = [(row, _skip_reason(row, backend, settings)) for row in ROWS]
    to_run = sum(reason is None for _, reason in planned)
    for row, reason in planned:
        if reason is not None:
            report.skipped.append({"row": row.name, "reason": reason})
            continue
        to_run -= 1
        limit = min(deadline - time.monotonic() - MIN_ROW_S * to_run, MAX_ROW_S)
        if row.kind != "plan" and report.plan is None:
            report.failed.append({"row": row.name, "reason": "not run: the plan row gave no plan"})
            continue
        if limit < MIN_ROW_S:
            report.failed.append({"row": row.name, "reason": f"not run: the {report.budget_s:.0f} s budget is spent"})
            continue
        console.print(f"device-perf: {row.name} (at most {limit:.0f} s)")
        outcome = runner(_request(row, backend, settings, report.plan), limit)
        report.row_seconds[row.name] = outcome.seconds
        _take(row, outcome, report, console)
        report.seconds = time.monotonic() - started
        if after_row is not None:
            after_row(report)
    report.seconds = time.monotonic() - started


def _skip_reason(row: PerfRow, backend: str, settings: PerfSettings) -> str | None:
    """Why ``row`` cannot run here (swap-bench's comparison rules for torchao), or ``None``."""
    if row.kind != "torchao":
        return None
    workload = Workload(
        settings.shape.name, tuple((shape, torch.bfloat16) for _, shape in settings.shape.parameter_shapes())
    )
    _, skipped = plan_comparisons([workload], ["torchao"], backend_name=backend)
    return skipped[0]["reason"] if skipped else None


def _request(row: PerfRow, backend: str, settings: PerfSettings, plan: TrainingPlan | None) -> dict[str, Any]:
    request: dict[str, Any] = {"kind": row.kind, "name": row.name, "backend": backend, "settings": settings.to_json()}
    if plan is not None:
        request["plan"] = plan.to_json()
        request["tokens"] = plan.tokens_long if row.tokens == "long" else plan.tokens_short
    return request


def _take(row: PerfRow, outcome: RowOutcome, report: DevicePerfReport, console: Console) -> None:
    """Put ``outcome`` into ``report``: the plan, a row, a skipped or a failed row."""
    result = outcome.result or {}
    console.print(f"device-perf: {row.name}: {outcome.seconds:.1f} s")
    if outcome.failure is not None:
        report.failed.append({"row": row.name, "reason": outcome.failure, "output_tail": outcome.output_tail})
        console.print(f"[red]device-perf: {row.name} failed[/]: {outcome.failure}")
    elif "skipped" in result:
        report.skipped.append({"row": row.name, "reason": result["skipped"]})
    elif "plan" in result:
        report.plan = TrainingPlan.from_json(result["plan"])
    else:
        report.rows.append(result["row"])


def run_in_own_process(request: dict[str, Any], limit_s: float) -> RowOutcome:
    """``python -m swap_bench.perf_rows`` on ``request``, killed after ``limit_s`` seconds."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="swap-device-perf-") as folder:
        request_path, result_path = Path(folder) / "request.json", Path(folder) / "result.json"
        request_path.write_text(json.dumps(request))
        command = [sys.executable, "-m", "swap_bench.perf_rows", str(request_path), str(result_path)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=limit_s, check=False)
        except subprocess.TimeoutExpired as expired:
            output = _text(expired.stdout) + _text(expired.stderr)
            return RowOutcome(
                time.monotonic() - started, failure=f"timed out after {limit_s:.0f} s", output_tail=output[-4000:]
            )
        output = done.stdout + done.stderr
        seconds = time.monotonic() - started
        if done.returncode != 0 or not result_path.is_file():
            last = (output.strip().splitlines() or [""])[-1]
            return RowOutcome(seconds, failure=f"exit status {done.returncode}: {last}", output_tail=output[-4000:])
        return RowOutcome(seconds, result=json.loads(result_path.read_text()))


def _text(output: str | bytes | None) -> str:
    if output is None:
        return ""
    return output if isinstance(output, str) else output.decode(errors="replace")


def device_perf_parser() -> argparse.ArgumentParser:
    """The parser of ``swap-bench device-perf``."""
    parser = command_parser(
        "swap-bench device-perf",
        "A bf16 decoder (about 1B parameters on a device) trained with AdamW over fp32 masters: plain (on the\n"
        "device) against swapped after the backward and inside it, and against torchao's CPUOffloadOptimizer; raw\n"
        "pinned copies and the link bandwidth each swapped step achieved. One process per row, within --budget-s.\n"
        "tools/device-perf.sh runs it on a lent GPU; --backend sim is its dry run (tiny sizes).",
    )
    parser.add_argument(
        "--backend", default="auto", choices=BACKEND_NAMES, help="the device (auto: an accelerator, else the simulator)"
    )
    parser.add_argument(
        "--model",
        default="auto",
        choices=["auto", *PERF_MODELS],
        help="the decoder and its sizes (auto: tiny on the simulator, 1b on a device)",
    )
    parser.add_argument(
        "--swap-times", type=positive_count, default=None, help="pipeline batches (default: 16 for 1b, 4 for tiny)"
    )
    _add_run_arguments(parser)
    return parser


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """How long each row runs, on what, and where the report goes."""
    parser.add_argument("--warmup", type=count, default=2, help="iterations of each optimizer before the timed ones")
    parser.add_argument(
        "--repeats",
        type=positive_count,
        default=None,
        help="timed iterations of each optimizer, alternated (default: 5, or 2 on the simulator)",
    )
    parser.add_argument(
        "--threads",
        type=positive_count,
        default=None,
        help="torch CPU threads (default: 1 on the simulator, torch's own choice on a device, where torchao's host "
        "AdamW runs on them)",
    )
    parser.add_argument(
        "--device-memory",
        type=byte_size,
        default=None,
        help="free device memory to size for (default: what the device reports; 1GiB on the simulator)",
    )
    parser.add_argument(
        "--budget-s", type=positive_count, default=400, help="seconds for all rows together (tools/device-perf.sh's)"
    )
    parser.add_argument(
        "--check-parity",
        action="store_true",
        help="exit 1 when a swapped row's parameters are not bitwise the plain ones (deterministic kernels: the "
        "simulator's dry run)",
    )
    parser.add_argument(
        "--json", type=output_file, default="swap-bench-device-perf.json", help="where to write the JSON report"
    )


def device_perf_main(argv: Sequence[str] | None = None) -> int:
    """The ``swap-bench device-perf`` command: every row, the table, the JSON report; 1 when a row failed."""
    parser = device_perf_parser()
    args = parser.parse_args(argv)
    refuse_a_missing_accelerator(parser, args.backend)
    backend, detail, _ = bench_backend(args.backend)
    settings = _settings(args, backend)
    console = Console(width=None if Console().is_terminal else 160)
    machine = {**device_facts(backend), "threads": settings.threads}
    report = DevicePerfReport(backend, detail, machine, settings, float(args.budget_s))
    _print_machine(machine, console)
    # Saved after each row too: a run cut short (the lent machine's time) still leaves the rows it measured.
    run_rows(settings, backend, report, console=console, after_row=lambda done: save_json(done.to_json(), args.json))
    render_device_perf(report, console)
    console.print(f"JSON report: {save_json(report.to_json(), args.json)}")
    parity = [row["name"] for row in report.rows if row["optimizer"] != "torchao" and not row["bitwise_equal"]]
    if args.check_parity and parity:
        console.print(f"[red]parity: not bitwise the plain optimizer: {', '.join(parity)}[/]")
        return 1
    return 1 if report.failed else 0


def _settings(args: argparse.Namespace, backend: str) -> PerfSettings:
    on_sim = backend == "sim"
    model = PERF_MODELS[("tiny" if on_sim else "1b") if args.model == "auto" else args.model]
    return PerfSettings(
        shape=model.shape,
        seq_len=model.seq_len,
        probe_tokens=model.probe_tokens,
        max_tokens=model.max_tokens,
        swap_times=args.swap_times or model.swap_times,
        warmup=args.warmup,
        repeats=args.repeats or (2 if on_sim else 5),
        link_bytes=model.link_bytes,
        device_memory=args.device_memory or (SIM_DEVICE_MEMORY if on_sim else None),
        threads=args.threads or (1 if on_sim else None),
    )


def _print_machine(machine: dict[str, Any], console: Console) -> None:
    facts = ("gpu", "driver", "driver_cuda", "torch", "torch_cuda", "link", "gpu_numa_node", "numa_nodes", "cpus")
    known = [f"{key} {machine[key]}" for key in facts if machine.get(key) is not None]
    console.print(f"device-perf, backend {machine['backend']}: " + ", ".join(known))


def render_device_perf(report: DevicePerfReport, console: Console) -> None:
    """The plan, the rows' table, the goals, and the skipped and failed rows, for a person."""
    plan = report.plan
    if plan is not None:
        link, backward_long = plan.link, plan.backward_seconds_per_token * plan.tokens_long
        console.print(
            f"raw pinned copies ({readable_bytes(link.nbytes)}): H2D {link.h2d / 1e9:.2f} GB/s, D2H "
            f"{link.d2h / 1e9:.2f} GB/s, both at once {link.duplex / 1e9:.2f} GB/s. Model {plan.shape.name}, "
            f"{plan.shape.num_hidden_layers} layers, {_count(plan.params)} parameters, bf16, AdamW over fp32 "
            f"masters; a step's copies take at least {readable_seconds(plan.transfer_seconds)}; tokens a step: "
            f"{plan.tokens_long:,} (backward about {readable_seconds(backward_long)}), short {plan.tokens_short:,}."
        )
    table = Table(
        title=f"device-perf, backend {report.backend}: medians of {report.settings.repeats} iterations of each, "
        "alternated with plain (AdamW over fp32 masters on the device)"
    )
    columns = (
        "row", "tokens", "backward", "plain", "iteration", "ratio", "added", "link GB/s", "of both ways", "each way",
        "batches (in bwd)", "bitwise",
    )  # fmt: skip
    for title in columns:
        table.add_column(title, justify="left" if title == "row" else "right")
    for row in report.rows:
        table.add_row(*_cells(row))
    console.print(table)
    for goal in report.goals():
        verdict = {True: "[green]met[/]", False: "[yellow]missed[/]", None: "not measured"}[goal["met"]]
        value = "" if goal["value"] is None else f" ({goal['value']:.3f} {goal['unit']})"
        console.print(f"goal: {goal['goal']}: {verdict}{value}")
    print_skipped(report.skipped, console)
    for failed in report.failed:
        console.print(f"[red]failed[/] {failed['row']}: {failed['reason']}")


def _count(params: int) -> str:
    return f"{params / 1e9:.3f}B" if params >= 10**8 else f"{params:,}"


def _cells(row: dict[str, Any]) -> Sequence[str]:
    rate, fraction = row["link_bytes_per_second"], row["link_fraction_of_raw"]
    batches = "-" if row["batches"] is None else f"{row['batches']} ({row['batches_in_backward']})"
    return (
        row["name"],
        f"{row['tokens']:,}",
        readable_seconds(row["backward_s"]),
        readable_seconds(row["plain_iteration_s"]),
        readable_seconds(row["iteration_s"]),
        f"{row['ratio']:.3f}",
        readable_seconds(row["added_s"]) if row["added_s"] >= 0 else f"-{readable_seconds(-row['added_s'])}",
        "-" if rate is None else f"{rate / 1e9:.2f}",
        "-" if fraction is None else f"{fraction:.0%}",
        "-" if row["h2d_bytes"] is None else readable_bytes(row["h2d_bytes"]),
        batches,
        "yes" if row["bitwise_equal"] else "no",
    )
