"""``swap-bench plan --tables``: one rank's swapped step for a real model size, modeled over meta tensors.

For each combination of the given models, world sizes, links, ranks per node and ``swap_times``, the planner builds
one rank's FSDP2 shard of the model (by default rank 0, whose shard is the largest: dim 0 of every
parameter split in ``world`` chunks, :func:`~swap_bench.models.fsdp_shard_shape`) as meta tensors,
runs the real swap pipeline on :class:`~swap_core.sim.MetaBackend` and reports the bytes and copies
(exact) and the virtual clock's seconds (modeled) of a cold step, next to the unswapped optimizer's
device memory. Nothing is allocated: llama-70b at world 8 takes a few seconds per row on a 2-core
machine.

A link preset is theoretical (``pcie5``) or measured (``pcie5-achievable``); ``ranks_per_node`` ranks share the
preset's host memory bandwidth, each streaming its states as the modeled one does.

Muon at ``world`` > 1 is swap-muon's distributed Muon: the parameters are FSDP2 DTensors on one rank
of a fake process group (:mod:`~swap_bench.fake_world`), each matrix is owned whole by one rank,
which alone keeps (and swaps) its momentum, so the ranks' state bytes differ (``--rank`` picks one).
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from rich.console import Console
from rich.progress import Progress

from swap_core import SwapConfig
from swap_core.errors import AdapterNotFoundError, DeviceMemoryError, UnsupportedOptimizerError
from swap_core.sim import LINK_PRESETS

from .arguments import (
    byte_size,
    command_parser,
    count,
    fraction,
    model_argument,
    output_file,
    positive_count,
    staging_count,
)
from .iteration import IterationModel, IterationRow, model_iteration
from .modeled import ModeledRow, StepModel, model_step
from .models import MODELS, ModelShape, fsdp_shard_shape
from .report import (
    SCHEMA,
    machine_facts,
    print_skipped,
    render_iteration_table,
    render_modeled_table,
    save_json,
)
from .workloads import OPTIMIZERS

__all__ = [
    "DEFAULT_SWAP_TIMES",
    "PLAN_OPTIMIZERS",
    "markdown_table",
    "plan_combinations",
    "plan_main",
    "plan_model",
    "plan_parser",
    "recommend",
]


def _default_swap_times() -> int:
    default = SwapConfig().swap_times
    assert isinstance(default, int), "SwapConfig's default swap_times is a count"
    return default


DEFAULT_SWAP_TIMES = _default_swap_times()
"""The batch count a plain ``SwapConfig()`` asks for: the planner's default, and what ``swap-bench plan`` tries
first."""

PLAN_OPTIMIZERS = ("adamw", "rmsprop", "sgd", "adagrad", "nadam", "muon")
"""Optimizers the planner models (``muon``: its 2-D parameters, distributed Muon from ``world`` 2 on, which
needs swap-muon; sgd, adagrad and nadam need swap-generic)."""


def plan_model(
    model: ModelShape,
    optimizer: str,
    *,
    world: int,
    link: str,
    swap_times: int | Literal["auto"],
    master_weights: bool = False,
    rank: int = 0,
    ranks_per_node: int = 1,
    device_memory: int | None = None,
    staging_buffers: int = 2,
    master_remainders: bool = True,
) -> ModeledRow:
    """Model rank ``rank``'s step for ``model`` sharded over ``world`` ranks by FSDP2, ``ranks_per_node`` of them
    sharing the host memory of the link preset ``link``; ``device_memory``: the device bytes the swap may use
    (``swap_times="auto"`` chooses the batches from them, and a staging beyond them is an out-of-memory);
    ``staging_buffers``: batches staged at a time (``SwapConfig.staging_buffers``).

    Parameters are bf16 with ``master_weights`` (masters swapped with the states: as the bits the parameters lack,
    or fp32 with ``master_remainders=False``, ``SwapConfig.master_remainders``), fp32 otherwise.
    The optimizer runs its foreach kernels (``foreach=True``, torch's default on CUDA), Muon its own;
    Muon over more than one rank is distributed Muon, stepped on FSDP2 DTensors in a fake process group.
    """
    _check_plan_arguments(optimizer, link, world=world, rank=rank, ranks_per_node=ranks_per_node)
    dtype = torch.bfloat16 if master_weights else torch.float32
    distributed = optimizer == "muon" and world > 1
    shapes = [shape for _, shape in model.parameter_shapes()]
    if not distributed:
        shapes = [fsdp_shard_shape(shape, world, rank) for shape in shapes]
    tensors = [(shape, dtype) for shape in shapes]
    step = StepModel(
        model.name,
        tensors,
        OPTIMIZERS[optimizer],
        link,
        swap_times,
        master_weights=master_weights,
        master_remainders=master_remainders,
        ranks_per_node=ranks_per_node,
        world=world,
        rank=rank,
        # torch's choice on a CUDA device; on meta tensors it would pick the single-tensor kernels.
        optimizer_options={} if optimizer == "muon" else {"foreach": True},
        fsdp2=distributed,
        device_memory=device_memory,
        staging_buffers=staging_buffers,
    )
    return model_step(step)


def _check_plan_arguments(optimizer: str, link: str, *, world: int, rank: int, ranks_per_node: int) -> None:
    """Refuse :func:`plan_model`'s arguments that name no planner optimizer or link preset, or no rank, naming the
    value."""
    if optimizer not in PLAN_OPTIMIZERS:
        raise ValueError(f"Unknown planner optimizer {optimizer!r}; expected one of {PLAN_OPTIMIZERS}")
    if link not in LINK_PRESETS:
        raise ValueError(f"Unknown link preset {link!r}; expected one of {tuple(LINK_PRESETS)}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"Invalid rank {rank} of world {world}: expected 0 <= rank < world")
    if ranks_per_node < 1:
        raise ValueError(f"Invalid ranks_per_node: {ranks_per_node} (expected >= 1)")


def recommend(
    model: ModelShape, optimizer: str, *, device_memory: int, **options: Any
) -> tuple[ModeledRow, list[ModeledRow]]:
    """The row of ``swap_times="auto"`` for ``device_memory`` (its ``batches`` the recommended count), and the rows
    of the neighbouring counts that fit too (one more batch, twice the batches), for their modeled step times."""
    chosen = plan_model(model, optimizer, swap_times="auto", device_memory=device_memory, **options)
    neighbours = []
    for batches in sorted({chosen.batches + 1, 2 * chosen.batches}):
        try:
            neighbours.append(plan_model(model, optimizer, swap_times=batches, device_memory=device_memory, **options))
        except torch.OutOfMemoryError:
            continue  # more batches than parameters leave one staging as large: not a choice
    return chosen, neighbours


def plan_combinations(
    models: Sequence[ModelShape],
    optimizer: str,
    *,
    worlds: Sequence[int],
    links: Sequence[str],
    swap_times: Sequence[int],
    master_weights: bool,
    console: Console,
    rank: int = 0,
    ranks_per_node: Sequence[int] = (1,),
    device_memory: int | None = None,
    staging_buffers: Sequence[int] = (2,),
) -> tuple[list[ModeledRow], list[dict[str, str]]]:
    """Every combination, with a progress bar; a combination that cannot be modeled is a skipped row. With
    ``device_memory``, each combination's recommended count and its neighbours (:func:`recommend`) instead of
    ``swap_times``."""
    counts: Sequence[int | None] = [None] if device_memory is not None else swap_times
    combinations = list(itertools.product(models, worlds, links, ranks_per_node, counts, staging_buffers))
    rows: list[ModeledRow] = []
    skipped: list[dict[str, str]] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("planning", total=len(combinations))
        for model, world, link, node_ranks, k, buffers in combinations:
            label = (
                f"{model.name} {optimizer} world={world} rank={rank} {link} ranks/node={node_ranks} k={k or 'auto'} "
                f"staged={buffers}"
            )
            progress.update(task, description=label)
            options: dict[str, Any] = {
                "world": world,
                "link": link,
                "master_weights": master_weights,
                "rank": rank,
                "ranks_per_node": node_ranks,
                "staging_buffers": buffers,
            }
            try:
                if k is None:
                    assert device_memory is not None
                    chosen, neighbours = recommend(model, optimizer, device_memory=device_memory, **options)
                    rows += [chosen, *neighbours]
                else:
                    rows.append(plan_model(model, optimizer, swap_times=k, **options))
            except (AdapterNotFoundError, UnsupportedOptimizerError, DeviceMemoryError) as error:
                skipped.append({"row": label, "reason": str(error).splitlines()[0]})
            progress.advance(task)
    return rows, skipped


def plan_main(argv: Sequence[str] | None = None) -> int:
    """The ``swap-bench plan --tables`` command: model the rows, print the table, write the JSON report."""
    parser = plan_parser()
    args = parser.parse_args(argv)
    models = [model_argument(name, parser) for name in args.model]
    for world in args.world:
        if not args.rank < world:
            parser.error(f"--rank must be in [0, {world}) for --world {world}, got {args.rank}")
    console = Console(width=None if Console().is_terminal else 240)
    started = time.perf_counter()
    rows, skipped = plan_combinations(
        models,
        args.optimizer,
        worlds=args.world,
        links=args.link,
        swap_times=args.swap_times,
        master_weights=args.master_weights,
        console=console,
        rank=args.rank,
        ranks_per_node=args.ranks_per_node,
        device_memory=args.device_memory,
        staging_buffers=args.staging_buffers,
    )
    document = _plan_report(rows, skipped, models, console, rank=args.rank)
    if args.tokens:
        iterations, not_modeled = plan_iterations(models, args, console)
        render_iteration_table(iterations, console)
        print_skipped(not_modeled, console)
        document["iteration_rows"] = [row.as_dict() for row in iterations]
        document["skipped"] += not_modeled
    if args.markdown is not None:
        Path(args.markdown).write_text(markdown_table(rows))
    seconds = time.perf_counter() - started
    console.print(f"planned {len(rows)} rows in {seconds:.1f} s; JSON report: {save_json(document, args.json)}")
    return 0


def plan_iterations(
    models: Sequence[ModelShape], args: argparse.Namespace, console: Console
) -> tuple[list[IterationRow], list[dict[str, str]]]:
    """``plan --tokens``: each combination's whole iteration (:func:`~swap_bench.iteration.model_iteration`), with a
    progress bar; one that cannot be modeled (ranks per node above the world, an optimizer the step inside the
    backward refuses) is a skipped row."""
    combinations = list(
        itertools.product(
            models, args.world, args.tokens, args.link, args.ranks_per_node, args.swap_times, args.staging_buffers
        )
    )
    rows: list[IterationRow] = []
    skipped: list[dict[str, str]] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("iterations", total=len(combinations))
        for model, world, tokens, link, node_ranks, k, buffers in combinations:
            label = (
                f"{model.name} {args.optimizer} world={world} tokens={tokens} {link} ranks/node={node_ranks} k={k} "
                f"staged={buffers}"
            )
            progress.update(task, description=label)
            spec = IterationModel(
                model,
                world,
                tokens,
                OPTIMIZERS[args.optimizer],
                link,
                swap_times=k,
                master_weights=args.master_weights,
                ranks_per_node=node_ranks,
                utilization=args.utilization,
                staging_buffers=buffers,
            )
            try:
                rows.append(model_iteration(spec))
            except (ValueError, AdapterNotFoundError, UnsupportedOptimizerError) as error:
                skipped.append({"row": f"iteration {label}", "reason": str(error).splitlines()[0]})
            progress.advance(task)
    return rows, skipped


def plan_parser() -> argparse.ArgumentParser:
    """The parser of ``swap-bench plan --tables``."""
    parser = command_parser(
        "swap-bench plan --tables",
        "Model one rank's swapped step for a real model size on a link, over meta tensors (nothing is\n"
        "allocated): device and host bytes and copies exact, seconds on the simulator's virtual clock.\n\n"
        "Columns: plain state GB, the unswapped optimizer's device bytes; device peak GB, the swapped step's;\n"
        "T_c, the plain update on the modeled device; step s, how far a cold step extends the compute stream;\n"
        "transfer s, from step() to its last copy; bound s, the pipeline's least transfer time for k batches.",
    )
    parser.add_argument(
        "--model",
        nargs="+",
        default=["llama-7b"],
        help=f"presets ({', '.join(MODELS)}) or paths to a Llama-style Hugging Face config.json",
    )
    parser.add_argument("--optimizer", default="adamw", choices=PLAN_OPTIMIZERS, help="the optimizer modeled")
    parser.add_argument("--world", nargs="+", type=positive_count, default=[8], help="FSDP2 ranks sharding the model")
    parser.add_argument(
        "--rank",
        type=count,
        default=0,
        help="the rank modeled (0 holds the largest FSDP2 shard; distributed Muon's ranks own different matrices)",
    )
    parser.add_argument(
        "--link",
        nargs="+",
        default=["pcie4"],
        choices=list(LINK_PRESETS),
        help="link presets: theoretical rates (pcie4, pcie5, ascend-910b) or measured ones (NAME-achievable)",
    )
    parser.add_argument(
        "--ranks-per-node",
        nargs="+",
        type=positive_count,
        default=[1],
        help="ranks sharing one host's memory bandwidth, each streaming its states as the modeled one (default 1)",
    )
    _add_batching_arguments(parser)
    parser.add_argument("--master-weights", action="store_true", help="bf16 parameters with fp32 masters swapped")
    _add_iteration_arguments(parser)
    _add_report_arguments(parser)
    return parser


def _add_batching_arguments(parser: argparse.ArgumentParser) -> None:
    """``--swap-times``, ``--staging-buffers`` and ``--device-memory``: the pipeline's batches, given or recommended
    for the device memory left to the swap."""
    parser.add_argument(
        "--swap-times",
        nargs="+",
        type=positive_count,
        default=[DEFAULT_SWAP_TIMES],
        help="pipeline batches per step (SwapConfig's default)",
    )
    parser.add_argument(
        "--staging-buffers",
        nargs="+",
        type=staging_count,
        default=[2],
        help="batches staged on the device at a time (SwapConfig.staging_buffers, at least 2): each one more holds "
        "one more batch on the device and lets the copy-ins run a batch further ahead (default 2)",
    )
    parser.add_argument(
        "--device-memory",
        type=byte_size,
        default=None,
        help="device memory the swap may use on each rank (what the model, gradients and activations leave), e.g. "
        "20GB or 18GiB: recommends the fewest batches whose staging fits 80%% of it (swap_times='auto'), with the "
        "modeled step of one more batch and of twice as many, instead of --swap-times",
    )


def _add_iteration_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tokens`` and ``--utilization``: whole modeled iterations (:mod:`~swap_bench.iteration`)."""
    parser.add_argument(
        "--tokens",
        nargs="+",
        type=positive_count,
        default=None,
        help="also model whole training iterations with this many tokens a rank (forward, backward, step), "
        "unswapped and swapped after and inside the backward (SwapConfig(step='in_backward')), for each "
        "--swap-times; off when not given",
    )
    parser.add_argument(
        "--utilization",
        type=fraction,
        default=0.4,
        help="with --tokens: the forward's and backward's share of the device's matmul peak",
    )


def _add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json`` and ``--markdown``: where the rows go."""
    parser.add_argument(
        "--json", type=output_file, default="swap-bench-plan.json", help="where to write the JSON report"
    )
    parser.add_argument(
        "--markdown",
        type=output_file,
        default=None,
        help="also write the rows as a Markdown table (docs/benchmarks.md)",
    )


def _plan_report(
    rows: list[ModeledRow], skipped: list[dict[str, str]], models: Sequence[ModelShape], console: Console, *, rank: int
) -> dict[str, Any]:
    """Print the table, what was skipped and each recommendation; the JSON report of the rows."""
    render_modeled_table(rows, console, title=f"swap-bench plan --tables: rank {rank} of an FSDP2 shard, cold step")
    print_skipped(skipped, console)
    for chosen in rows:
        if chosen.swap_times == "auto" and chosen.device_memory is not None:
            console.print(
                f"recommended for {chosen.name} world={chosen.world} {chosen.link}: swap_times={chosen.batches} "
                f"(device peak {chosen.device_peak_state_bytes / 1e9:.2f} GB of {chosen.device_memory / 1e9:.2f} GB, "
                f"modeled step {chosen.modeled_step_seconds:.3f} s)"
            )
    return {
        "schema": SCHEMA,
        "kind": "plan",
        "machine": machine_facts(),
        "models": {model.name: {**vars(model), "numel": model.numel} for model in models},
        "rows": [],
        "skipped": skipped,
        "comparisons": [],
        "modeled_rows": [row.as_dict() for row in rows],
        "narrowing_rows": [],
        "iteration_rows": [],
        "device_perf_rows": [],
    }


def markdown_table(rows: Sequence[ModeledRow]) -> str:
    """The rows as the Markdown table of docs/benchmarks.md (GB are 10^9 bytes; seconds modeled)."""
    lines = [
        "| model | params/rank | link | ranks/node | k | unswapped state GB | swapped: device peak GB | host GB "
        "| copies | T_c ms | step s | transfer s | bound s | link busy |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.name}{' + fp32 masters' if row.master_weights else ''} | {row.params / 1e9:.3f}B | {row.link} "
            f"| {row.ranks_per_node} | {row.batches_label} | {row.plain_state_device_bytes / 1e9:.2f} "
            f"| {row.device_peak_state_bytes / 1e9:.2f} | {row.host_state_bytes / 1e9:.2f} | {row.copies} "
            f"| {row.update_seconds * 1e3:.1f} "
            f"| {row.modeled_step_seconds:.3f} | {row.modeled_transfer_seconds:.3f} | {row.bound_seconds:.3f} "
            f"| {100 * row.link_utilization:.0f}% |"
        )
    return "\n".join(lines) + "\n"
