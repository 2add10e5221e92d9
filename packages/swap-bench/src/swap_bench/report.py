"""The benchmark's two outputs: a rich table for people, a JSON document for tools."""

from __future__ import annotations

import dataclasses
import json
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from .iteration import IterationRow
from .link import LinkBandwidth
from .measure import ComparisonResult, RowResult
from .modeled import ModeledRow

__all__ = [
    "SCHEMA",
    "BenchReport",
    "machine_facts",
    "print_skipped",
    "render_iteration_table",
    "render_modeled_table",
    "render_table",
    "save_json",
]

SCHEMA = "swap-bench/9"
"""Version tag of the JSON document; bumped when fields change meaning (2: ``modeled_rows`` and ``kind``; 3:
``kind`` ``"narrowing"`` and ``narrowing_rows``, empty in the other kinds; 4: modeled rows' ``ranks_per_node`` and
``link_model``, and a ``bound_seconds`` that counts the link's duplex factor and host memory share; 5:
``iteration_rows``, whole modeled iterations of ``plan --tokens``, empty in the other kinds; 6: modeled and
iteration rows' ``staging_buffers``; 7: ``kind`` ``"device-perf"`` and ``device_perf_rows``, empty in the other
kinds; 8: iteration rows' ``clipping``, ``host_bytes_after_backward`` and ``host_bytes_in_backward``)."""


@dataclasses.dataclass
class BenchReport:
    backend: str
    backend_detail: str
    quick: bool
    threads: int
    link: LinkBandwidth
    host_allocator: str = "system"
    """How the host allocator was set up (on the simulator the 'device' allocates from it)."""
    rows: list[RowResult] = dataclasses.field(default_factory=list)
    skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)
    comparisons: list[ComparisonResult] = dataclasses.field(default_factory=list)
    """Plain AdamW against external offloading baselines (CUDA only; see ``comparisons.py``)."""
    modeled: list[ModeledRow] = dataclasses.field(default_factory=list)
    """The measured rows' configurations modeled on the virtual clock over meta tensors (``--link``)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "kind": "bench",
            "machine": {**machine_facts(), "threads": self.threads, "host_allocator": self.host_allocator},
            "backend": self.backend,
            "backend_detail": self.backend_detail,
            "quick": self.quick,
            "link": {
                "h2d_gbps": self.link.h2d / 1e9,
                "d2h_gbps": self.link.d2h / 1e9,
                "duplex_gbps": self.link.duplex / 1e9,
                "bytes": self.link.nbytes,
            },
            "rows": [row.as_dict() for row in self.rows],
            "skipped": self.skipped,
            "comparisons": [comparison.as_dict() for comparison in self.comparisons],
            "modeled_rows": [row.as_dict() for row in self.modeled],
            "narrowing_rows": [],
            "iteration_rows": [],
            "device_perf_rows": [],
        }

    def save(self, path: str | Path) -> Path:
        return save_json(self.to_json(), path)


def machine_facts() -> dict[str, str]:
    """Where the report was made (for modeled rows: where they were computed, which changes nothing)."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def save_json(document: dict[str, Any], path: str | Path) -> Path:
    """Write a report (no NaN or infinity: strict JSON) and return where."""
    target = Path(path)
    target.write_text(json.dumps(document, indent=2, allow_nan=False))
    return target


def render_table(report: BenchReport, console: Console) -> None:
    link = report.link
    console.print(
        f"[bold]swap-bench[/] backend={report.backend} ({report.backend_detail}), threads={report.threads}; "
        f"raw pinned copies: H2D {link.h2d / 1e9:.2f} GB/s, D2H {link.d2h / 1e9:.2f} GB/s, "
        f"both at once {link.duplex / 1e9:.2f} GB/s; host allocator: {report.host_allocator}"
    )
    table = Table(show_lines=False)
    for title in (
        "workload",
        "opt",
        "k",
        "layout",
        "plain ms",
        "swapped ms",
        "ratio",
        "floor eff",
        "H2D MB",
        "copies",
        "GB/s",
        "ideal %",
        "µs/batch",
        "peak MB swapped/plain",
    ):
        table.add_column(title, justify="right" if title not in ("workload", "opt", "layout") else "left")
    for row in report.rows:
        table.add_row(*_cells(row))
    console.print(table)
    if report.comparisons:
        console.print(_comparison_table(report.comparisons))
    if report.modeled:
        render_modeled_table(
            report.modeled, console, title=f"the same rows modeled on the virtual clock ({report.modeled[0].link})"
        )
    print_skipped(report.skipped, console)


def print_skipped(skipped: Sequence[dict[str, str]], console: Console) -> None:
    """The skipped rows, one line for each reason: ``skipped ROW: REASON``, or ``skipped N rows (A, B, ...):
    REASON`` where several share it."""
    by_reason: dict[str, list[str]] = {}
    for row in skipped:
        by_reason.setdefault(row["reason"], []).append(row["row"])
    for reason, rows in by_reason.items():
        which = rows[0] if len(rows) == 1 else f"{len(rows)} rows ({', '.join(rows)})"
        console.print(f"[yellow]skipped[/] {which}: {reason}")


def _cells(row: RowResult) -> Sequence[str]:
    layout = ("packed" if row.packed else "per-tensor") + ("" if row.duplex else " 1-stream")
    return (
        row.workload,
        row.optimizer,
        str(row.swap_times),
        layout,
        f"{row.plain_step_s * 1e3:.1f}",
        f"{row.swapped_step_s * 1e3:.1f}",
        f"{row.ratio:.2f}",
        "-" if row.copy_floor_efficiency is None else f"{row.copy_floor_efficiency:.2f}",
        f"{row.h2d_bytes / 2**20:.1f}",
        f"{row.h2d_copies}+{row.d2h_copies}",
        f"{row.achieved_gbps:.2f}",
        f"{row.ideal_percent:.0f}",
        "hidden" if row.overhead_per_batch_s is None else f"{row.overhead_per_batch_s * 1e6:.1f}",
        f"{row.peak_state_device_bytes_swapped / 2**20:.1f}/{row.peak_state_device_bytes_unswapped / 2**20:.1f}",
    )


def _comparison_table(comparisons: Sequence[ComparisonResult]) -> Table:
    table = Table(title="plain AdamW vs external offloading baselines (gradients through autograd + step)")
    for title in ("workload", "baseline", "plain ms", "baseline ms", "ratio", "bitwise", "max |diff|"):
        table.add_column(title, justify="left" if title in ("workload", "baseline") else "right")
    for row in comparisons:
        table.add_row(
            row.workload,
            row.baseline,
            f"{row.plain_step_s * 1e3:.1f}",
            f"{row.baseline_step_s * 1e3:.1f}",
            f"{row.ratio:.2f}",
            "yes" if row.bitwise_equal else "no",
            "non-finite" if row.max_abs_diff is None else f"{row.max_abs_diff:.2e}",
        )
    return table


def render_modeled_table(rows: Sequence[ModeledRow], console: Console, *, title: str) -> None:
    """Modeled rows: bytes exact, seconds on the virtual clock, each in the unit that fits it."""
    table = Table(
        title=f"{title}; seconds are modeled, not measured",
        caption="T_c: the plain update on the modeled device. step: how far a cold step extends the compute stream. "
        "transfer: from step() to its last copy. bound: the pipeline's least transfer time for k batches.",
    )
    columns = (
        "model", "opt", "world", "link", "ranks/node", "k", "params/rank", "plain state", "device peak",
        "host", "copies", "T_c", "step", "transfer", "bound", "transfer/bound", "link busy",
    )  # fmt: skip
    for title_text in columns:
        table.add_column(
            title_text, justify="left" if title_text in ("model", "opt", "link") else "right", no_wrap=True
        )
    for row in rows:
        table.add_row(
            row.name + (" +masters" if row.master_weights else ""),
            row.optimizer,
            str(row.world),
            row.link,
            str(row.ranks_per_node),
            row.batches_label + ("" if row.packed else " per-tensor") + ("" if row.duplex else " 1-stream"),
            f"{row.params / 1e9:.3f}B" if row.params >= 10**8 else f"{row.params:,}",
            readable_bytes(row.plain_state_device_bytes),
            readable_bytes(row.device_peak_state_bytes),
            readable_bytes(row.host_state_bytes),
            str(row.copies),
            readable_seconds(row.update_seconds),
            readable_seconds(row.modeled_step_seconds),
            readable_seconds(row.modeled_transfer_seconds),
            readable_seconds(row.bound_seconds),
            f"{row.modeled_transfer_seconds / row.bound_seconds:.3f}" if row.bound_seconds > 0 else "-",
            f"{100 * row.link_utilization:.0f}%",
        )
    console.print(table)


def render_iteration_table(rows: Sequence[IterationRow], console: Console) -> None:
    """Modeled whole iterations (``plan --tokens``): forward start to forward start, three ways, and the bound."""
    table = Table(
        title="swap-bench plan --tables --tokens: one rank's training iteration; seconds are modeled, not measured",
        caption="after/inside: swapped, stepping after the backward or inside it (SwapConfig(step='in_backward')), "
        "each over the unswapped iteration. bound: every swapped byte in and out once, both ways at once. host: "
        "the swapped optimizer's host bytes; inside, with provisional updates: a second copy of the states and a "
        "copy of the parameters without masters.",
    )
    columns = (
        "model", "opt", "world", "tokens", "link", "ranks/node", "k", "compute", "unswapped", "after", "inside",
        "bound", "inside/lower bound", "host after/inside",
    )  # fmt: skip
    for title_text in columns:
        table.add_column(title_text, justify="left" if title_text in ("model", "opt", "link") else "right")
    for row in rows:
        table.add_row(
            row.name + (" +masters" if row.master_weights else ""),
            row.optimizer,
            str(row.world),
            f"{row.tokens:,}",
            row.link,
            str(row.ranks_per_node),
            str(row.swap_times) + (f" ({row.staging_buffers} staged)" if row.staging_buffers != 2 else ""),
            readable_seconds(row.compute_seconds),
            readable_seconds(row.unswapped_seconds),
            f"{row.after_backward_seconds / row.unswapped_seconds:.3f} x",
            f"{row.in_backward_seconds / row.unswapped_seconds:.3f} x",
            readable_seconds(row.transfer_bound_seconds),
            f"{row.in_backward_seconds / row.lower_bound_seconds:.3f} x",
            f"{readable_bytes(row.host_bytes_after_backward)} / {readable_bytes(row.host_bytes_in_backward)}",
        )
    console.print(table)


def readable_bytes(count: int) -> str:
    """``count`` bytes in the decimal unit that keeps 3 significant digits (``12.3 MB``, ``51.9 GB``)."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count} B"


def readable_seconds(seconds: float) -> str:
    """``seconds`` in s, ms or µs, 4 significant digits."""
    for unit, size in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= size:
            return f"{seconds / size:.4g} {unit}"
    return f"{seconds / 1e-6:.4g} µs"
