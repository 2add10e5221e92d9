"""Demo: the GPT of train_gpt.py in bfloat16, trained three ways, to show what master weights are for.

The same bf16 model (same initial weights) sees the same batches three times:

1. ``plain bf16``: ``torch.optim.AdamW`` on the bf16 parameters; its moments are bf16 too;
2. ``fp32 masters``: the reference, AdamW over fp32 copies of the parameters (the masters),
   each step ``m.grad = p.grad.float()``, ``step()``, ``p.copy_(m)``; masters and moments on the device;
3. ``swapped masters``: ``swap_optimizer(AdamW(bf16 params), SwapConfig(master_weights=True))``: the
   same math, with masters and moments in host memory between steps, streamed through the device
   during ``step()``.

Run 3 must be bitwise run 2 (every loss, every final parameter and master): the script exits with
status 1 if it is not. It writes to ``--out`` (default ``out/demo-bf16``; ``out/demo-bf16-quick`` with ``--quick``):

- ``bf16_loss_curves.png``: the three loss curves (2 and 3 overlaid; 1 shows what bf16 moments cost);
- ``bf16_device_memory.png``: device bytes of parameters, gradients and optimizer state, between
  steps and at the peak of a step, for the three runs;
- ``summary.json``: the numbers.

Without an accelerator the swapped run uses the simulated accelerator (``sync`` mode, checks off;
``--checked`` turns on its race checker and NaN poison)::

    python examples/train_gpt_bf16.py            # 150 steps
    python examples/train_gpt_bf16.py --quick    # 20 steps
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import nn
from torch.nn import functional
from train_gpt import (
    ADAMW,
    CLIP_NORM,
    CharGPT,
    MiB,
    RunRecord,
    batches,
    bitwise_equal,
    finish_loss_plot,
    load_corpus,
    warmup_cosine,
    write_summary,
)

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.master_weights import master_of
from swap_core.sim import SimBackend
from swap_core.testing.masters import MasterReference

try:
    from matplotlib.figure import Figure
except ImportError:  # pragma: no cover - depends on the environment
    raise SystemExit("examples/train_gpt_bf16.py draws its plots with matplotlib: pip install matplotlib") from None

RUNS = ("plain bf16", "fp32 masters", "swapped masters")
PLOTS = {"loss": "bf16_loss_curves.png", "memory": "bf16_device_memory.png"}


def adamw(params: list[torch.Tensor]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, **ADAMW)  # type: ignore[arg-type]


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's non-scalar state tensors (moments, masters; not ``step``)."""
    values = (value for state in optimizer.state.values() for value in state.values())
    return tensor_bytes(value for value in values if torch.is_tensor(value) and value.dim())


def train(
    model: nn.Module,
    step: Callable[[], None],
    schedule_on: torch.optim.Optimizer,
    corpus: Any,
    args: argparse.Namespace,
    progress: Progress,
    label: str,
) -> RunRecord:
    """``args.steps`` steps over the batches of ``args.seed``: forward, backward, clip, ``step()``, LR schedule."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(schedule_on, warmup_cosine(args.steps))
    record = RunRecord()
    task = progress.add_task(label, total=args.steps, loss="")
    started = time.perf_counter()
    data = batches(corpus, args.seed, torch.device("cpu"))
    for _ in range(args.steps):
        inputs, targets = next(data)
        logits = model(inputs)
        loss = functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        model.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        step()
        scheduler.step()
        record.losses.append(loss.item())
        progress.update(task, advance=1, loss=f"loss {record.losses[-1]:.4f}")
    record.seconds = time.perf_counter() - started
    return record


def bf16_models(vocab_size: int, seed: int) -> list[CharGPT]:
    """Three bf16 models with the same initial weights."""
    torch.manual_seed(seed)
    initial = CharGPT(vocab_size).to(torch.bfloat16).state_dict()
    models = []
    for _ in RUNS:
        model = CharGPT(vocab_size).to(torch.bfloat16)
        model.load_state_dict(initial)
        models.append(model)
    return models


def parity(reference: MasterReference, swapped: SwapOptimizer, records: dict[str, RunRecord]) -> dict[str, Any]:
    swapped.synchronize()
    expected, actual = records["fp32 masters"].losses, records["swapped masters"].losses
    params = swapped.param_groups[0]["params"]
    return {
        "losses_identical": expected == actual,
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(expected, actual, strict=True)),
        "final_parameters_identical": all(map(bitwise_equal, reference.params, params)),
        "final_masters_identical": all(
            bitwise_equal(master, master_of(swapped, param))  # either form of the master, as fp32
            for master, param in zip(reference.masters, params, strict=True)
        ),
        "plain_bf16_max_abs_loss_diff": max(
            abs(a - b) for a, b in zip(records["plain bf16"].losses, expected, strict=True)
        ),
    }


def memory(
    models: list[CharGPT], plain: torch.optim.Optimizer, reference: MasterReference, swapped: SwapOptimizer
) -> dict[str, dict[str, int]]:
    """Device bytes of each run: parameters and their gradients, and optimizer state between steps / at the peak."""
    weights = tensor_bytes(param.detach() for param in models[0].parameters())
    gradients = weights  # bf16 gradients, one per parameter, in every run
    masters = tensor_bytes(master.detach() for master in reference.masters)
    return {
        "plain bf16": {"weights_and_grads": weights + gradients, "state_between": state_bytes(plain)},
        # The masters (4 bytes per parameter), their fp32 gradients (4 more) and the fp32 moments (8).
        "fp32 masters": {
            "weights_and_grads": weights + gradients,
            "state_between": state_bytes(reference.optimizer) + masters + masters,
        },
        "swapped masters": {
            "weights_and_grads": weights + gradients,
            "state_between": swapped.stats.resident_state_device_bytes,
            "state_peak": swapped.stats.peak_state_device_bytes,
        },
    }


def plot_losses(records: dict[str, RunRecord], result: dict[str, Any], path: Path) -> None:
    """The three loss curves (they overlap at this scale), and under them each run's difference from the fp32
    masters' loss: the drift of bf16 moments shows there, and the swapped run's line stays at zero."""
    figure = Figure(figsize=(8, 6.5), layout="constrained")
    axes, drift = figure.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    steps = range(1, len(records["plain bf16"].losses) + 1)
    masters = records["fp32 masters"].losses
    for run, color, style in (("plain bf16", "tab:red", "-"), ("swapped masters", "tab:orange", "--")):
        difference = [loss - master for loss, master in zip(records[run].losses, masters, strict=True)]
        drift.plot(steps, difference, color=color, linewidth=1.2, linestyle=style, label=f"{run} - fp32 masters")
    drift.axhline(0.0, color="tab:blue", linewidth=0.8, alpha=0.5)
    drift.set_xlabel("step")
    drift.set_ylabel("loss difference")
    drift.grid(alpha=0.3)
    drift.legend(fontsize=8.5)
    axes.plot(steps, records["plain bf16"].losses, color="tab:red", linewidth=1.2, label="plain AdamW, bf16 moments")
    axes.plot(steps, records["fp32 masters"].losses, color="tab:blue", linewidth=5, alpha=0.35, label="fp32 masters")
    axes.plot(
        steps,
        records["swapped masters"].losses,
        color="tab:orange",
        linewidth=1.2,
        linestyle="--",
        label="swapped, master_weights=True",
    )
    verdict = "bitwise identical" if result["losses_identical"] else "DIFFERENT"
    finish_loss_plot(figure, axes, f"bf16 GPT: swapped masters vs fp32 masters on the device: {verdict}", path)


def plot_memory(numbers: dict[str, dict[str, int]], path: Path) -> None:
    figure = Figure(figsize=(8, 5.2), layout="constrained")
    axes = figure.subplots()
    positions = range(len(RUNS))
    weights = [numbers[run]["weights_and_grads"] / MiB for run in RUNS]
    between = [numbers[run]["state_between"] / MiB for run in RUNS]
    peak = [numbers[run].get("state_peak", numbers[run]["state_between"]) / MiB for run in RUNS]
    axes.bar(positions, weights, color="tab:gray", label="bf16 weights + gradients")
    state_label = "optimizer state (with fp32 master grads), between steps"
    axes.bar(positions, between, bottom=weights, color="tab:blue", label=state_label)
    extra = [top - low for top, low in zip(peak, between, strict=True)]
    bottoms = [w + b for w, b in zip(weights, between, strict=True)]
    axes.bar(positions, extra, bottom=bottoms, color="tab:orange", alpha=0.5, label="more at the peak of step()")
    for position, total in zip(positions, [w + p for w, p in zip(weights, peak, strict=True)], strict=True):
        axes.annotate(f"{total:.2f} MiB", (position, total), ha="center", va="bottom")
    axes.set_xticks(list(positions), list(RUNS))
    axes.set_ylim(0, max(w + p for w, p in zip(weights, peak, strict=True)) * 1.12)
    axes.set_ylabel("device MiB")
    axes.set_title("Device memory of a bf16 GPT trained with AdamW")
    figure.legend(loc="outside lower center", ncols=2, fontsize=8.5)
    axes.grid(alpha=0.3, axis="y")
    figure.savefig(path, dpi=90)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: 150)")
    parser.add_argument("--quick", action="store_true", help="20 steps: a smoke run")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for plots and summary.json (default: out/demo-bf16, or "
        "out/demo-bf16-quick with --quick, so that a smoke run leaves the full run's plots alone)",
    )
    parser.add_argument("--checked", action="store_true", help="simulator with race checks, poison, random order")
    parser.add_argument("--swap-times", type=int, default=4, help="batches per swapped step (default: 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batches")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 20 if args.quick else 150
    if args.out is None:
        args.out = Path("out/demo-bf16-quick" if args.quick else "out/demo-bf16")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    return args


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    console = Console()
    backend = (
        SimBackend(mode="random", seed=args.seed, check_races=True, poison=True)
        if args.checked
        else SimBackend(mode="sync", check_races=False, poison=False)
    )
    corpus = load_corpus()
    models = bf16_models(len(corpus.alphabet), args.seed)
    parameters = sum(param.numel() for param in models[0].parameters())
    console.print(f"bf16 GPT, {parameters:,} parameters, {args.steps} steps; swapped on the simulated accelerator")

    plain = adamw(list(models[0].parameters()))
    reference = MasterReference(list(models[1].parameters()), adamw)
    config = SwapConfig(backend=backend, swap_times=args.swap_times, min_numel=1024, master_weights=True)
    swapped = swap_optimizer(adamw(list(models[2].parameters())), config)
    loss_column = TextColumn("{task.fields[loss]}")
    columns = (TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(), loss_column)
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        records = {
            # ``lambda: opt.step()``, not ``opt.step``: the LR scheduler wraps ``step`` on the instance when it is
            # built, and a bound method taken before would bypass it (torch then warns of a wrong order).
            "plain bf16": train(models[0], lambda: plain.step(), plain, corpus, args, progress, RUNS[0]),
            "fp32 masters": train(
                models[1], lambda: reference.step(), reference.optimizer, corpus, args, progress, RUNS[1]
            ),
            "swapped masters": train(models[2], lambda: swapped.step(), swapped, corpus, args, progress, RUNS[2]),
        }
    result = parity(reference, swapped, records)
    numbers = memory(models, plain, reference, swapped)

    table = Table(title="device bytes (MiB)")
    for column in ("run", "weights + grads", "state between steps", "state at the peak", "host state"):
        table.add_column(column, justify="right")
    host = {"swapped masters": swapped.stats.host_state_bytes}
    for run in RUNS:
        row = numbers[run]
        peak = row.get("state_peak", row["state_between"])
        cells = (row["weights_and_grads"], row["state_between"], peak, host.get(run, 0))
        table.add_row(run, *(f"{value / MiB:.2f}" for value in cells))
    console.print(table)

    args.out.mkdir(parents=True, exist_ok=True)
    plots = {name: args.out / filename for name, filename in PLOTS.items()}
    plot_losses(records, result, plots["loss"])
    plot_memory(numbers, plots["memory"])
    summary = write_summary(
        args.out / "summary.json",
        steps=args.steps,
        parameters=parameters,
        parameter_numels=[param.numel() for param in models[0].parameters()],
        config={"swap_times": args.swap_times, "master_weights": True, **ADAMW},
        parity=result,
        losses={run: record.losses for run, record in records.items()},
        device_bytes=numbers,
        host_state_bytes=swapped.stats.host_state_bytes,
        seconds={run: record.seconds for run, record in records.items()},
        races=len(backend.races) if backend.check_races else None,
        plots={name: str(path) for name, path in plots.items()},
    )
    checks = ("losses_identical", "final_parameters_identical", "final_masters_identical")
    identical = all(result[key] for key in checks)
    if identical:
        console.print(
            f"master-weights parity: identical, {args.steps}/{args.steps} losses, every parameter and master bitwise "
            f"equal to fp32 masters on the device (plain bf16 AdamW drifts by up to "
            f"{result['plain_bf16_max_abs_loss_diff']:.3g} in loss)",
            style="bold green",
        )
    else:
        console.print(f"master-weights parity: DIFFERENT: {result}", style="bold red")
    console.print(f"plots: {', '.join(str(path) for path in plots.values())}\nnumbers: {summary}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
