"""The ``swap-bench plan`` command: the verdict of :func:`~swap_bench.fit.judge` on one screen of 100 columns."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from swap_core.sim import LINK_PRESETS

from .arguments import byte_size, command_parser, model_argument, positive_count
from .fit import Job, Verdict, judge
from .models import MODELS
from .report import readable_bytes, readable_seconds

__all__ = ["fit_main", "fit_parser", "render_verdict"]

WIDTH = 100
"""The verdict's width in columns, at most."""


def fit_parser() -> argparse.ArgumentParser:
    """The parser of ``swap-bench plan`` (the verdict; ``--tables`` is read by :mod:`swap_bench.cli` first)."""
    parser = command_parser(
        "swap-bench plan",
        "Will one training job fit, and how much slower will it be? One rank's device memory at the step's peak\n"
        "(weights, gradients, an estimate of the activations, the swap's staging), a node's pinned host memory,\n"
        "the modeled iteration unswapped and swapped, and the SwapConfig to use. Modeled over meta tensors: nothing\n"
        "is allocated. `swap-bench plan --tables` prints the full tables behind it.",
    )
    parser.add_argument(
        "--tables",
        action="store_true",
        help="print the planner's full tables instead: the options after it are theirs (swap-bench plan --tables "
        "--help)",
    )
    parser.add_argument("--model", default="llama-7b", help=f"a preset ({', '.join(MODELS)}) or a config.json path")
    parser.add_argument("--world", type=positive_count, default=8, help="FSDP2 ranks (default 8)")
    parser.add_argument("--ranks-per-node", type=positive_count, default=8, help="ranks a node (default 8)")
    parser.add_argument("--device-memory", type=byte_size, default=80 * 10**9, help="of one device (default 80GB)")
    parser.add_argument(
        "--host-memory", type=byte_size, default=None, help="of one node, e.g. 1TB (default: unchecked)"
    )
    parser.add_argument(
        "--fp32", action="store_true", help="fp32 parameters (default: bf16 parameters with fp32 master weights)"
    )
    parser.add_argument("--tokens", type=positive_count, default=4096, help="a rank's tokens a micro-batch (4096)")
    parser.add_argument("--activation-checkpointing", action="store_true", help="each layer recomputed in the backward")
    parser.add_argument("--link", default="pcie5-achievable", choices=list(LINK_PRESETS), help="the host link")
    parser.add_argument("--no-iterations", action="store_true", help="skip the modeled iterations (faster)")
    return parser


def fit_main(argv: Sequence[str] | None = None) -> int:
    """``swap-bench plan``: judge the job and print the verdict; 0 when it fits, 1 when it does not."""
    parser = fit_parser()
    args = parser.parse_args(argv)
    if args.ranks_per_node > args.world:
        parser.error(f"--ranks-per-node ({args.ranks_per_node}) must be at most --world ({args.world})")
    job = Job(
        model=model_argument(args.model, parser),
        world=args.world,
        ranks_per_node=args.ranks_per_node,
        device_memory=args.device_memory,
        host_memory=args.host_memory,
        master_weights=not args.fp32,
        tokens=args.tokens,
        activation_checkpointing=args.activation_checkpointing,
        link=args.link,
        iterations=not args.no_iterations,
    )
    console = Console(width=WIDTH if not Console().is_terminal else min(WIDTH, Console().width))
    with console.status(f"modeling {job.model.name} at world {job.world} on {job.link}"):
        verdict = judge(job)
    render_verdict(verdict, console)
    return 0 if verdict.fits else 1


def render_verdict(verdict: Verdict, console: Console) -> None:
    """The verdict, its device and host memory, the iterations and the configuration to paste."""
    job = verdict.job
    parts = [
        f"[bold]{job.model.name}[/]",
        "bf16, fp32 masters" if job.master_weights else "fp32",
        f"world {job.world} ({job.ranks_per_node} a node)",
        f"{job.tokens:,} tokens",
        *(["checkpointed"] if job.activation_checkpointing else []),
        job.link,
    ]
    console.print(", ".join(parts))
    console.print(_headline(verdict))
    console.print(_memory_table(verdict))
    if verdict.iteration is not None:
        console.print(_iteration_table(verdict))
    if verdict.step is not None:
        console.print(f"Use: [bold]{verdict.config_line()}[/]")
    note = _mode_note(verdict)
    if note:
        console.print(note)


def _mode_note(verdict: Verdict) -> str:
    """Why the step is not inside the backward, where that would be faster."""
    row, job = verdict.iteration, verdict.job
    faster_inside = row is not None and row.in_backward_seconds < row.after_backward_seconds
    if verdict.mode == "in_backward" or not faster_inside or job.host_memory is None:
        return ""
    assert row is not None
    return (
        f"Stepping inside the backward would take {row.in_backward_seconds / row.unswapped_seconds:.2f} x, but its "
        f"second host copy needs {readable_bytes(verdict.host_inside)} pinned a node, more than "
        f"{readable_bytes(job.host_memory)}."
    )


def _headline(verdict: Verdict) -> str:
    job = verdict.job
    if verdict.step is None:
        return (
            f"[bold red]Does not fit[/]: weights, gradients and activations take "
            f"{readable_bytes(verdict.device.total)} of the device's {readable_bytes(job.device_memory)}, and no "
            "batch count's staging fits what is left. Shard over more ranks, checkpoint activations or use fewer "
            "tokens a rank."
        )
    unswapped = "it fits unswapped too" if verdict.fits_unswapped else "it does not fit unswapped"
    if not verdict.fits_device:
        return f"[bold red]Does not fit[/] the device: {readable_bytes(verdict.device_peak)} at the peak."
    if not verdict.fits_host:
        return f"[bold red]Does not fit[/] the host: {readable_bytes(verdict.host_bytes_per_node)} pinned a node."
    return f"[bold green]Fits[/] ({unswapped})."


def _memory_table(verdict: Verdict) -> Table:
    job, device, step = verdict.job, verdict.device, verdict.chosen_step
    table = Table(title="Memory at the step's peak", title_justify="left", width=WIDTH)
    table.add_column("", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("what", ratio=1)
    sharded = job.world > 1
    weights = "the rank's shard, two layers gathered" if sharded else "the model's"
    gradients = "the shard's, one layer's before its reduce-scatter" if sharded else "the model's"
    table.add_row("weights", readable_bytes(device.weights), weights)
    table.add_row("gradients", readable_bytes(device.gradients), gradients)
    table.add_row("activations", readable_bytes(device.activations), "an estimate (bf16, fused attention)")
    if step is not None:
        batches = f"{step.batches} batches, two staged at a time, and the resident states"
        table.add_row("swap staging", readable_bytes(step.device_peak_state_bytes), batches)
        unswapped = readable_bytes(step.plain_state_device_bytes)
        table.add_row("device peak", readable_bytes(verdict.device_peak), f"of {readable_bytes(job.device_memory)}")
        table.add_row("  unswapped", unswapped, "the optimizer's states (and masters) on the device instead")
        node = "of " + readable_bytes(job.host_memory) if job.host_memory is not None else "host memory unchecked"
        place = "inside" if verdict.mode == "in_backward" else "after"
        table.add_row(
            "host a node", readable_bytes(verdict.host_bytes_per_node), f"pinned, stepping {place} the backward, {node}"
        )
    return table


def _iteration_table(verdict: Verdict) -> Table:
    row = verdict.iteration
    assert row is not None
    table = Table(title="One iteration, modeled on the virtual clock", title_justify="left", width=WIDTH)
    for column in ("unswapped", "step after the backward", "step inside the backward", "least possible"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_row(
        readable_seconds(row.unswapped_seconds),
        f"{readable_seconds(row.after_backward_seconds)} ({row.after_backward_seconds / row.unswapped_seconds:.2f} x)",
        f"{readable_seconds(row.in_backward_seconds)} ({row.in_backward_seconds / row.unswapped_seconds:.2f} x)",
        f"{readable_seconds(row.lower_bound_seconds)} ({row.lower_bound_seconds / row.unswapped_seconds:.2f} x)",
    )
    return table
