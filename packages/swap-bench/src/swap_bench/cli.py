"""``swap-bench`` / ``python -m swap_bench``: swapped vs unswapped steps, measured in one run."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Sequence

import torch
from rich.console import Console
from rich.progress import Progress

from swap_core import DeviceBackend
from swap_core.config import BACKEND_NAMES
from swap_core.errors import AdapterNotFoundError, UnsupportedOptimizerError
from swap_core.sim import LINK_PRESETS

from .arguments import command_parser, count, output_file, positive_count
from .bench_backend import bench_backend, refuse_a_missing_accelerator
from .comparisons import BASELINES, ComparisonConfig, plan_comparisons
from .device_perf import device_perf_main, device_perf_parser
from .fit_cli import fit_main, fit_parser
from .host_allocator import keep_freed_host_memory
from .link import measure_link
from .measure import RowConfig, measure_comparison, measure_row
from .modeled import StepModel, model_step
from .narrowing import narrowing_main, narrowing_parser
from .planner import plan_main, plan_parser
from .report import BenchReport, render_table
from .workloads import OPTIMIZERS, QUICK_WORKLOADS, WORKLOADS, Workload

__all__ = ["main", "parse_command", "plan_rows", "run_bench"]

CPU_SKIP_REASON = (
    "Muon's Newton-Schulz runs in bfloat16, which takes seconds per step on a CPU (about 52 s for the "
    "transformer workload on the 2-core CI machine): Muon rows need an accelerator, or --quick"
)


def plan_rows(
    workloads: Sequence[Workload], optimizers: Sequence[str], *, quick: bool, on_cpu: bool
) -> tuple[list[RowConfig], list[dict[str, str]]]:
    """A swap_times sweep (packed, duplex) plus per-tensor and single-stream rows at one swap_times.

    Returns the rows to measure and the rows left out, with the reason.
    """
    sweep = (2, 4) if quick else (2, 4, 8, 16)
    reference = sweep[1] if quick else 4
    rows: list[RowConfig] = []
    skipped: list[dict[str, str]] = []
    for workload, name in itertools.product(workloads, optimizers):
        optimizer = OPTIMIZERS[name]
        planned = [RowConfig(workload, optimizer, k, True, True) for k in sweep]
        planned.append(RowConfig(workload, optimizer, reference, False, True))
        planned.append(RowConfig(workload, optimizer, reference, True, False))
        if on_cpu and not quick and name == "muon":
            skipped.extend({"row": row.label, "reason": CPU_SKIP_REASON} for row in planned)
            continue
        rows.extend(planned)
    return rows, skipped


def run_bench(
    rows: Sequence[RowConfig],
    backend_factory: Callable[[], DeviceBackend],
    *,
    backend_name: str,
    backend_detail: str,
    quick: bool,
    threads: int,
    host_allocator: str = "system",
    warmup: int,
    repeats: int,
    console: Console,
    comparisons: Sequence[ComparisonConfig] = (),
    link_model: str | None = None,
) -> BenchReport:
    """Measure the link, then every row and comparison in turn (a progress bar on ``console``), into one report.

    A row whose optimizer no installed adapter serves, or that swapping refuses, becomes a skipped row
    naming the reason; so does a comparison baseline that fails. With ``link_model`` (a link preset),
    every measured row is also modeled over meta tensors on that link (:func:`~swap_bench.modeled.model_step`).
    """
    link_bytes = 8 * 2**20 if quick else 256 * 2**20
    link = measure_link(backend_factory(), link_bytes)
    report = BenchReport(backend_name, backend_detail, quick, threads, link, host_allocator=host_allocator)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(rows) + len(comparisons))
        for row in rows:
            progress.update(task, description=row.label)
            try:
                report.rows.append(measure_row(row, backend_factory, report.link, warmup=warmup, repeats=repeats))
                if link_model is not None:
                    report.modeled.append(model_step(_modeled(row, link_model)))
            except (AdapterNotFoundError, UnsupportedOptimizerError, ModuleNotFoundError) as error:
                report.skipped.append({"row": row.label, "reason": str(error).splitlines()[0]})
            progress.advance(task)
        for comparison in comparisons:
            progress.update(task, description=comparison.label)
            _run_comparison(comparison, backend_factory, report, warmup=warmup, repeats=repeats)
            progress.advance(task)
    return report


def _modeled(row: RowConfig, link: str) -> StepModel:
    workload = row.workload
    return StepModel(
        workload.name, workload.tensors, row.optimizer, link, row.swap_times, packed=row.packed, duplex=row.duplex
    )


def _run_comparison(
    comparison: ComparisonConfig,
    backend_factory: Callable[[], DeviceBackend],
    report: BenchReport,
    *,
    warmup: int,
    repeats: int,
) -> None:
    """Measure one comparison row into ``report``; a baseline that fails is a skipped row carrying its error.

    Third-party code runs here (imports, kernel builds, steps): an optional baseline must never lose the rows
    already measured.
    """
    baseline = comparison.baseline
    try:
        result = measure_comparison(
            comparison.workload, baseline.name, baseline.build, backend_factory, warmup=warmup, repeats=repeats
        )
    except Exception as error:
        first_line = (str(error).splitlines() or [""])[0]
        report.skipped.append({"row": comparison.label, "reason": f"failed: {type(error).__name__}: {first_line}"})
    else:
        report.comparisons.append(result)


SMOKE_RUN = (
    "[bold yellow]--quick: a smoke run[/] (tiny workloads, one timed step): it checks that every row runs, and its "
    "timings are not results (a ratio above or below 1, a negative time per batch, are noise here). Run without "
    "--quick for the figures."
)
"""Said after a ``--quick`` run's table."""

COMMANDS = """commands:
  swap-bench [options]              measure swapped against plain steps on this machine (below)
  swap-bench plan [options]         will a job fit, and how much slower: a verdict on one screen (llama-70b...)
  swap-bench plan --tables [...]    the tables behind it: one rank of a real model on links, bytes exact, time modeled
  swap-bench narrowing [options]    the host time of swap-generic's narrowed step per batch
  swap-bench device-perf [options]  a bf16 decoder's training iterations, plain, swapped and CPU-offloaded, and the
                                    link bandwidth the swapped steps achieve (a GPU; --backend sim: a dry run)
each takes --help"""


Subcommand = tuple[Callable[[], argparse.ArgumentParser], Callable[[Sequence[str]], int]]
"""A subcommand's parser and its main."""

TABLES = "--tables"
"""``swap-bench plan --tables ...``: the planner's tables instead of the verdict (the options after it are theirs)."""

SUBCOMMANDS: dict[str, Subcommand] = {
    "plan": (fit_parser, fit_main),  # will one job fit (swap_bench.fit_cli); with --tables, the planner's tables
    "narrowing": (narrowing_parser, narrowing_main),  # swap-generic's narrowed step (swap_bench.narrowing)
    "device-perf": (device_perf_parser, device_perf_main),  # training iterations on a device (swap_bench.device_perf)
}
"""``swap-bench NAME ...``: each subcommand's parser and its main."""


def _subcommand(arguments: Sequence[str]) -> tuple[str, Subcommand, list[str]] | None:
    """The subcommand ``arguments`` name (``"plan --tables"`` for the planner's tables), and its own arguments."""
    if not arguments or arguments[0] not in SUBCOMMANDS:
        return None
    name, rest = arguments[0], list(arguments[1:])
    if name == "plan" and TABLES in rest:
        rest.remove(TABLES)
        return f"plan {TABLES}", (plan_parser, plan_main), rest
    return name, SUBCOMMANDS[name], rest


def parse_command(argv: Sequence[str]) -> tuple[str, argparse.Namespace]:
    """The command ``swap-bench ARGV`` runs (``"measure"``, ``"plan"``, ``"plan --tables"``, ``"narrowing"`` or
    ``"device-perf"``) and its options, read as it would read them, without running anything: a documented command
    line can be checked this way. A bad option exits as the command would (``SystemExit`` with status 2, the usage on
    stderr)."""
    arguments = list(argv)
    found = _subcommand(arguments)
    if found is not None:
        name, (parser, _), rest = found
        return name, parser().parse_args(rest)
    return "measure", _measure_parser().parse_args(arguments)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``swap-bench`` command: parse ``argv``, benchmark, print the table and write the JSON report; or run the
    subcommand ``argv`` names (:data:`SUBCOMMANDS`)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    found = _subcommand(arguments)
    if found is not None:
        _, (_, run), rest = found
        return run(rest)
    parser = _measure_parser()
    args = parser.parse_args(arguments)
    refuse_a_missing_accelerator(parser, args.backend)
    torch.set_num_threads(args.threads)
    backend_name, detail, factory = bench_backend(args.backend)
    host_allocator = "system"
    if backend_name == "sim" and not args.system_allocator:
        host_allocator = keep_freed_host_memory() or "system (glibc mallopt unavailable)"
    table = QUICK_WORKLOADS if args.quick else WORKLOADS
    workloads = [table[name] for name in args.workloads]
    rows, left_out = plan_rows(workloads, args.optimizers, quick=args.quick, on_cpu=backend_name == "sim")
    baselines = args.compare if "adamw" in args.optimizers else []
    comparisons, comparisons_left_out = plan_comparisons(workloads, baselines, backend_name=backend_name)
    console = Console(width=None if Console().is_terminal else 240)
    report = run_bench(
        rows,
        factory,
        backend_name=backend_name,
        backend_detail=detail,
        quick=args.quick,
        threads=args.threads,
        host_allocator=host_allocator,
        warmup=args.warmup if args.warmup is not None else (1 if args.quick else 2),
        repeats=args.repeats if args.repeats is not None else (1 if args.quick else 9),
        console=console,
        comparisons=comparisons,
        link_model=args.link,
    )
    report.skipped[:0] = [*left_out, *comparisons_left_out]
    render_table(report, console)
    if args.quick:
        console.print(SMOKE_RUN)
    console.print(f"JSON report: {report.save(args.json)}")
    return 0


def _measure_parser() -> argparse.ArgumentParser:
    """The options of ``swap-bench`` (measure)."""
    parser = command_parser(
        "swap-bench",
        COMMANDS
        + "\n\nswap-bench (measure): each workload's step with the optimizer plain and swapped, alternately in one\n"
        "run, their ratio, the raw pinned-copy bandwidth, and the same rows modeled on a link (virtual clock).",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny workloads, one repeat: a smoke run for CI (its timings are not results)",
    )
    parser.add_argument(
        "--backend", default="auto", choices=BACKEND_NAMES, help="the device (auto: an accelerator, else the simulator)"
    )
    parser.add_argument(
        "--optimizers", nargs="+", default=["adamw", "muon"], choices=sorted(OPTIMIZERS), help="optimizers measured"
    )
    parser.add_argument(
        "--workloads", nargs="+", default=sorted(WORKLOADS), choices=sorted(WORKLOADS), help="parameter sets"
    )
    _add_timing_arguments(parser)
    parser.add_argument("--json", type=output_file, default="swap-bench.json", help="where to write the JSON report")
    parser.add_argument(
        "--compare",
        nargs="*",
        default=list(BASELINES),
        choices=list(BASELINES),
        help="external offloading baselines to hold plain AdamW against (CUDA only, with adamw among --optimizers; "
        "rows that cannot run are listed as skipped); give no names for none",
    )
    parser.add_argument(
        "--system-allocator",
        action="store_true",
        help="on the simulator, keep glibc's default of returning freed blocks to the kernel (see host_allocator)",
    )
    parser.add_argument(
        "--link",
        default="pcie4",
        choices=list(LINK_PRESETS),
        help="the link the rows are also modeled on (virtual clock, meta tensors), beside the measured ones",
    )
    return parser


def _add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """``--threads``, ``--warmup`` and ``--repeats``: how each row's steps are timed."""
    parser.add_argument(
        "--threads", type=positive_count, default=1, help="torch CPU threads (the simulator's 'device')"
    )
    parser.add_argument(
        "--warmup", type=count, default=None, help="steps before timing (default: 2, or 1 with --quick)"
    )
    parser.add_argument(
        "--repeats", type=positive_count, default=None, help="timed steps (default: 9, or 1 with --quick)"
    )
