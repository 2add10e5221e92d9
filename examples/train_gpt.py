"""Demo: train a small character-level GPT twice, with plain and with swapped AdamW, and plot it.

The text is real and ships with torch: its own Python sources (``torch/optim`` and
``torch/nn/modules``, concatenated in sorted order). The same model (same initial weights) sees
the same batches twice: first with ``torch.optim.AdamW``, then with the same optimizer wrapped by
``swap_optimizer(..., SwapConfig(swap_times=4, ...))``, whose ``exp_avg`` / ``exp_avg_sq`` live in
pinned host memory between steps and stream through the device in 4 batches during ``step()``.
The two loss curves must be bitwise identical: the script exits with status 1 if they are not.

Without an accelerator the swapped run uses swap's simulated accelerator in ``sync`` mode with
its checks off (fast); ``--checked`` turns on its race checker and NaN poison instead. With an
accelerator (``torch.accelerator.is_available()``) the model moves there and the backend is
``"auto"``. It writes three PNG plots and ``summary.json`` to ``--out`` (default ``out/demo``;
``out/demo-quick`` with ``--quick``):

- ``loss_curves.png``: the loss of both runs, overlaid;
- ``state_memory.png``: device bytes of optimizer state per step: plain AdamW (all of it) vs
  swapped (between steps: only the resident small states; during the step: the peak);
- ``step_timeline.png``: one swapped step's pipeline (H2D copy, update, D2H copy per batch).

The timeline comes from ``SwapConfig(trace=True)``, which makes every traced step wait for the
device. So that the two compared runs stay untraced, one extra step (step N + 1) is traced on
copies: a copy of the trained model and a fresh AdamW loaded from the swapped optimizer's
``state_dict()``, wrapped with ``trace=True`` and stepped once with the next batch.

    python examples/train_gpt.py                  # 150 steps, sim (or the accelerator when present)
    python examples/train_gpt.py --quick          # 20 steps
    python examples/train_gpt.py --checked --out out/checked
    python examples/train_gpt.py --quick --step in_backward   # each batch updates inside the backward

With ``--step in_backward`` the swapped run steps inside the backward (``SwapConfig(step="in_backward")``): each
batch updates as soon as its gradients are final, and ``step()`` ends the step. Neither run clips its gradients
then (swap refuses a clip after such a backward); the losses must still be bitwise identical, and the timeline
shows the traced step's batches timed from the hook that began it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from torch import nn
from torch.nn import functional

from swap_core import DeviceBackend, SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.errors import AdapterNotFoundError
from swap_core.sim import SimBackend
from swap_core.trace import PHASES, StepTrace

try:
    # The object-oriented API (no pyplot, no global state); Figure.savefig renders PNGs with Agg.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
except ImportError:  # pragma: no cover - depends on the environment
    raise SystemExit("examples/train_gpt.py draws its plots with matplotlib: pip install matplotlib") from None

BACKENDS = ("sim", "auto", "cuda", "npu", "xpu")
WIDTH, HEADS, LAYERS, CONTEXT, BATCH_SIZE = 128, 4, 4, 64, 16
CORPUS_DIRS = ("optim", "nn/modules")
CORPUS_CHARS = 640_000
ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.01}
WARMUP_FRACTION, CLIP_NORM = 0.1, 1.0
MiB = 1024**2
PLOTS = {"loss": "loss_curves.png", "memory": "state_memory.png", "timeline": "step_timeline.png"}


# -- model and data ------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    """Multi-head attention written out (matmul, mask, softmax): deterministic on every device."""

    future: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("future", torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, _ = hidden.shape
        query, key, value = self.qkv(hidden).view(batch, length, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        scores = query @ key.transpose(-2, -1) / math.sqrt(WIDTH // HEADS)
        weights = scores.masked_fill(self.future[:length, :length], float("-inf")).softmax(dim=-1)
        mixed = (weights @ value).transpose(1, 2).reshape(batch, length, WIDTH)
        projected: torch.Tensor = self.proj(mixed)
        return projected


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(WIDTH)
        self.attn = CausalSelfAttention()
        self.mlp_norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.attn_norm(hidden))
        output: torch.Tensor = hidden + self.mlp(self.mlp_norm(hidden))
        return output


class CharGPT(nn.Module):
    """Token and position embeddings, ``LAYERS`` causal blocks, a final norm and an ``lm_head``."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, WIDTH)
        self.pos_embeddings = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.final_norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.blocks(self.tok_embeddings(tokens) + self.pos_embeddings(positions))
        logits: torch.Tensor = self.lm_head(self.final_norm(hidden))
        return logits


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Character-level text: the token ids and where the text came from."""

    tokens: torch.Tensor
    alphabet: str
    files: int
    source: str


def load_corpus() -> Corpus:
    """torch's own sources: every ``.py`` under ``CORPUS_DIRS`` in sorted order, cut at ``CORPUS_CHARS``."""
    torch_root = Path(torch.__file__).parent
    paths = [path for directory in CORPUS_DIRS for path in sorted((torch_root / directory).glob("*.py"))]
    parts: list[str] = []
    length = 0
    for path in paths:
        if length >= CORPUS_CHARS:
            break
        parts.append(path.read_text(encoding="utf-8"))
        length += len(parts[-1])
    text = "".join(parts)[:CORPUS_CHARS]
    alphabet = "".join(sorted(set(text)))
    index = {char: position for position, char in enumerate(alphabet)}
    tokens = torch.tensor([index[char] for char in text], dtype=torch.long)
    return Corpus(tokens, alphabet, len(parts), f"torch {torch.__version__}: {', '.join(CORPUS_DIRS)}")


def batches(corpus: Corpus, seed: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Random windows of ``CONTEXT + 1`` characters, the same sequence for the same ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(CONTEXT + 1)
    while True:
        starts = torch.randint(0, len(corpus.tokens) - CONTEXT - 1, (BATCH_SIZE, 1), generator=generator)
        windows = corpus.tokens[starts + offsets].to(device)
        yield windows[:, :-1], windows[:, 1:]


# -- the two runs --------------------------------------------------------------------------------
@dataclasses.dataclass
class RunRecord:
    """What one training run produced, step by step."""

    losses: list[float] = dataclasses.field(default_factory=list)
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    resident_bytes: list[int] = dataclasses.field(default_factory=list)
    peak_bytes: list[int] = dataclasses.field(default_factory=list)
    sim_peak_bytes: list[int] = dataclasses.field(default_factory=list)
    """Device bytes the simulator counted at the peak of each step (``max_memory_allocated``)."""
    sim_between_bytes: list[int] = dataclasses.field(default_factory=list)
    """Device bytes the simulator counted after each step (``memory_allocated``)."""
    seconds: float = 0.0


def make_optimizer(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), **ADAMW)  # type: ignore[arg-type]


def warmup_cosine(steps: int) -> Callable[[int], float]:
    """LR factor: linear warm-up over the first ``WARMUP_FRACTION`` of the steps, then cosine to 10%."""
    warmup = max(1, int(WARMUP_FRACTION * steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return factor


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor, *, clip: bool
) -> tuple[torch.Tensor, float]:
    """Forward, backward, clip (``clip``), step; returns the loss and the seconds ``optimizer.step()`` took."""
    logits = model(inputs)
    loss = functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if clip:
        nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    synchronize(inputs.device)
    started = time.perf_counter()
    optimizer.step()
    synchronize(inputs.device)
    return loss.detach(), time.perf_counter() - started


def clips(args: argparse.Namespace) -> bool:
    """Both runs clip the gradients' norm after the backward, except with ``--step in_backward``: the batches
    update inside the backward, before a clip could reach them (swap refuses the clip there)."""
    return bool(args.step == "after_backward")


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    corpus: Corpus,
    args: argparse.Namespace,
    progress: Progress,
    description: str,
    after_step: Callable[[RunRecord], None] | None = None,
) -> RunRecord:
    """``args.steps`` steps over the batches of ``args.seed``, with a warm-up + cosine LR schedule."""
    device = next(model.parameters()).device
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps))
    record = RunRecord()
    task = progress.add_task(description, total=args.steps, loss="")
    started = time.perf_counter()
    data = batches(corpus, args.seed, device)
    for _ in range(args.steps):
        inputs, targets = next(data)
        loss, step_seconds = train_step(model, optimizer, inputs, targets, clip=clips(args))
        scheduler.step()
        record.losses.append(loss.item())
        record.step_seconds.append(step_seconds)
        if after_step is not None:
            after_step(record)
        progress.update(task, advance=1, loss=f"loss {record.losses[-1]:.4f}")
    record.seconds = time.perf_counter() - started
    return record


def state_device_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's tensor states (``exp_avg``, ``exp_avg_sq``; not the scalar ``step``)."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


def make_backend(args: argparse.Namespace) -> tuple[DeviceBackend | str, torch.device]:
    """The swapped run's backend, and the device both runs' models live on."""
    if args.backend == "sim":
        if args.checked:
            # Copies at seeded random points, NaN poison in fresh memory, every access race-checked.
            return SimBackend(mode="random", seed=args.seed, check_races=True, poison=True), torch.device("cpu")
        # Copies run when issued and nothing is checked: the simulator adds no cost of its own.
        return SimBackend(mode="sync", check_races=False, poison=False), torch.device("cpu")
    if args.backend == "auto":
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None:
            raise SystemExit("--backend auto needs an accelerator; none is available (try --backend sim)")
        return "auto", accelerator
    return args.backend, torch.device(args.backend)


def describe_backend(backend: DeviceBackend | str, device: torch.device) -> str:
    if not isinstance(backend, SimBackend):
        return f"{device} (backend {backend!r})"
    checks = ", race-checked" if backend.check_races else ""
    return f"simulated accelerator, {backend.mode} mode{checks}"


def wrap(optimizer: torch.optim.AdamW, config: SwapConfig) -> SwapOptimizer:
    try:
        return swap_optimizer(optimizer, config)
    except AdapterNotFoundError as error:
        raise SystemExit(f"{error}\nThis demo swaps AdamW: install swap-adam next to swap-core.") from error


def run_swapped(
    model: nn.Module, corpus: Corpus, args: argparse.Namespace, config: SwapConfig, progress: Progress
) -> tuple[RunRecord, SwapOptimizer]:
    optimizer = wrap(make_optimizer(model), config)
    sim = config.backend if isinstance(config.backend, SimBackend) else None

    def record_memory(record: RunRecord) -> None:
        record.resident_bytes.append(optimizer.stats.resident_state_device_bytes)
        record.peak_bytes.append(optimizer.stats.peak_state_device_bytes)
        if sim is not None:
            # The simulator counts what swap allocates on the device: staging arenas and resident states.
            record.sim_peak_bytes.append(sim.max_memory_allocated())
            record.sim_between_bytes.append(sim.memory_allocated())
            sim.reset_peak_memory_stats()

    if sim is not None:
        sim.reset_peak_memory_stats()
    record = train(model, optimizer, corpus, args, progress, "swapped AdamW", record_memory)
    return record, optimizer


def trace_one_more_step(
    model: nn.Module, optimizer: SwapOptimizer, corpus: Corpus, args: argparse.Namespace, config: SwapConfig
) -> StepTrace:
    """Step N + 1 on copies (model and optimizer state), traced; the compared runs stay untraced."""
    replica = copy.deepcopy(model)
    plain = make_optimizer(replica)
    state_dict = optimizer.state_dict()
    # Own copies: the swapped optimizer's state_dict() holds views of its packed host buffer, which
    # load_state_dict() would keep (and swap_optimizer() would not swap: a view does not own its storage).
    state_dict["state"] = {
        index: {key: value.clone() for key, value in state.items()} for index, state in state_dict["state"].items()
    }
    plain.load_state_dict(state_dict)
    traced = wrap(plain, config.replace(trace=True))
    data = batches(corpus, args.seed, next(replica.parameters()).device)
    for _ in range(args.steps):
        next(data)
    train_step(replica, traced, *next(data), clip=clips(args))
    assert traced.trace is not None
    return traced.trace


# -- checks and reports ------------------------------------------------------------------------
def bitwise_equal(first: torch.Tensor, second: torch.Tensor) -> bool:
    if first.dtype != second.dtype or first.shape != second.shape:
        return False
    first_bytes = first.detach().cpu().contiguous().flatten().view(torch.uint8)
    second_bytes = second.detach().cpu().contiguous().flatten().view(torch.uint8)
    return torch.equal(first_bytes, second_bytes)


def parity(plain: RunRecord, swapped: RunRecord, plain_model: nn.Module, swapped_model: nn.Module) -> dict[str, Any]:
    plain_losses = torch.tensor(plain.losses, dtype=torch.float64)
    swapped_losses = torch.tensor(swapped.losses, dtype=torch.float64)
    parameters_identical = all(
        bitwise_equal(first, second)
        for first, second in zip(plain_model.parameters(), swapped_model.parameters(), strict=True)
    )
    return {
        "identical": bitwise_equal(plain_losses, swapped_losses),
        "max_abs_diff": (plain_losses - swapped_losses).abs().max().item(),
        "final_parameters_identical": parameters_identical,
    }


def stats_table(optimizer: SwapOptimizer, baseline_bytes: int, plain: RunRecord, swapped: RunRecord) -> Table:
    stats = optimizer.stats
    peak = max(swapped.peak_bytes)
    table = Table(title="swapped AdamW, last step (opt.stats)")
    table.add_column("", style="bold")
    table.add_column("value", justify="right")
    table.add_column("", style="dim")
    table.add_row("batches", str(stats.batches), f"swap_times={optimizer.config.swap_times}")
    table.add_row("H2D", f"{stats.h2d_bytes:,} B", f"{stats.h2d_copies} copies")
    table.add_row("D2H", f"{stats.d2h_bytes:,} B", f"{stats.d2h_copies} copies")
    table.add_row("host state (pinned)", f"{stats.host_state_bytes:,} B", "swapped exp_avg + exp_avg_sq")
    table.add_row("device state, plain AdamW", f"{baseline_bytes:,} B", "all of it, always")
    table.add_row("device state, in-step peak", f"{peak:,} B", f"{peak / baseline_bytes:.0%} of plain")
    table.add_row(
        "device state, between steps",
        f"{stats.resident_state_device_bytes:,} B",
        f"resident small states (numel < {optimizer.config.min_numel})",
    )
    if optimizer.config.step == "in_backward":
        # The updates ran inside the backward: step() only finishes them, so its time is not the optimizer's.
        table.add_row(
            "optimizer.step(), median",
            f"{1000 * statistics.median(swapped.step_seconds):.2f} ms",
            f"the updates ran inside the backward ({stats.batches_in_backward} batches); "
            f"plain step(): {1000 * statistics.median(plain.step_seconds):.2f} ms",
        )
    else:
        table.add_row(
            "optimizer.step(), median",
            f"{1000 * statistics.median(swapped.step_seconds):.2f} ms",
            f"plain: {1000 * statistics.median(plain.step_seconds):.2f} ms",
        )
    return table


def sim_cross_check(swapped: RunRecord) -> bool | None:
    """Whether the simulator's byte counts equal ``opt.stats`` (peak and resident) at every step."""
    if not swapped.sim_peak_bytes:
        return None
    return swapped.sim_peak_bytes == swapped.peak_bytes and swapped.sim_between_bytes == swapped.resident_bytes


# -- plots ---------------------------------------------------------------------------------------
def plot_losses(plain: RunRecord, swapped: RunRecord, result: dict[str, Any], path: Path) -> None:
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    axes = figure.subplots()
    steps = range(1, len(plain.losses) + 1)
    axes.plot(steps, plain.losses, color="tab:blue", linewidth=5, alpha=0.35, label="plain AdamW")
    axes.plot(steps, swapped.losses, color="tab:orange", linewidth=1.2, linestyle="--", label="swapped AdamW")
    verdict = "bitwise identical" if result["identical"] else f"DIFFERENT (max |Δ| = {result['max_abs_diff']:.3g})"
    finish_loss_plot(figure, axes, f"Training loss of a char-level GPT on torch's own sources: {verdict}", path)


def finish_loss_plot(figure: Figure, axes: Any, title: str, path: Path) -> None:
    """Title, axis labels, grid and legend of a loss-per-step plot; saved as a PNG at ``path``."""
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy loss (nats / character)")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=90)


def plot_memory(baseline_bytes: int, swapped: RunRecord, backend_label: str, path: Path) -> None:
    figure = Figure(figsize=(8, 4.8), layout="constrained")
    axes = figure.subplots()
    steps = list(range(1, len(swapped.peak_bytes) + 1))
    peak = [value / MiB for value in swapped.peak_bytes]
    resident = [value / MiB for value in swapped.resident_bytes]
    baseline_label = f"plain AdamW, all the time ({baseline_bytes / MiB:.2f} MiB)"
    axes.plot(steps, [baseline_bytes / MiB] * len(steps), color="tab:blue", linewidth=2.5, label=baseline_label)
    peak_label = f"swapped, peak during step() ({max(swapped.peak_bytes) / MiB:.2f} MiB)"
    axes.plot(steps, peak, color="tab:orange", linewidth=2.5, label=peak_label)
    resident_label = f"swapped, between steps: resident small states ({max(swapped.resident_bytes) / 1024:.1f} KiB)"
    axes.plot(steps, resident, color="tab:green", linewidth=3, label=resident_label)
    axes.fill_between(steps, resident, peak, color="tab:orange", alpha=0.12)
    if swapped.sim_peak_bytes:
        every = max(1, len(steps) // 25)
        measured = [value / MiB for value in swapped.sim_peak_bytes[::every] + swapped.sim_between_bytes[::every]]
        label = "the simulator's own count (max_memory_allocated, memory_allocated)"
        axes.plot(steps[::every] * 2, measured, linestyle="none", marker="x", color="black", label=label)
    figure.legend(loc="outside lower center", ncols=2, fontsize=8.5)
    axes.set_ylim(0, baseline_bytes / MiB * 1.1)
    axes.set_title(f"Device memory held by optimizer state ({backend_label})")
    axes.set_xlabel("step")
    axes.set_ylabel("MiB")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    figure.savefig(path, dpi=90)


def trace_clock(backend: DeviceBackend | str, device: torch.device) -> str:
    """What the trace's times are, for the timeline's axis."""
    if not isinstance(backend, SimBackend):
        return f"device events on {device}"
    if backend.mode == "sync":
        return "simulator clock, sync mode: each copy runs when issued, so nothing overlaps"
    return f"simulator clock, {backend.mode} mode: copies run when forced or at random points"


def plot_timeline(trace: StepTrace, step: int, clock: str, path: Path, *, in_backward: bool = False) -> None:
    figure = Figure(figsize=(9, 3.8), layout="constrained")
    axes = figure.subplots()
    lanes = {"h2d": "H2D copy", "update": "update", "d2h": "D2H copy"}
    span = 1000 * trace.seconds
    for interval in trace:
        lane = PHASES.index(interval.phase)
        start, width = 1000 * interval.start, 1000 * interval.seconds
        axes.broken_barh([(start, width)], (lane - 0.3, 0.6), facecolor=f"C{interval.batch % 10}", alpha=0.85)
        # Wide bars carry their label inside; narrow ones (copies) above, or below for odd batches.
        label_lane = lane if width > 0.04 * span else lane + (0.42 if interval.batch % 2 else -0.42)
        axes.text(start + width / 2, label_lane, interval.label, ha="center", va="center", fontsize=8)
    axes.set_yticks(range(len(PHASES)), [lanes[phase] for phase in PHASES])
    axes.set_ylim(len(PHASES) - 0.4, -0.6)
    axes.set_xlim(0, span * 1.02)
    batch_count = len({interval.batch for interval in trace if interval.phase == "h2d"})
    swapped_mib = sum(interval.nbytes for interval in trace if interval.phase == "h2d") / MiB
    where = ", inside the backward" if in_backward else ""
    axes.set_title(
        f"Pipeline of one swapped step (step {step}{where}): {batch_count} batches, {swapped_mib:.2f} MiB in and out"
    )
    began = "the backward's first gradient hook" if in_backward else "the start of step()"
    axes.set_xlabel(f"ms since {began} ({clock})")
    axes.grid(axis="x", alpha=0.3)
    figure.savefig(path, dpi=90)


# -- main ----------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: 150)")
    parser.add_argument("--quick", action="store_true", help="20 steps: a smoke run")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the plots and summary.json (default: out/demo, or "
        "out/demo-quick with --quick, so that a smoke run leaves the full run's plots alone)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="device backend; default: 'auto' when an accelerator is present, else 'sim'",
    )
    parser.add_argument("--checked", action="store_true", help="simulator with race checks, poison, random order")
    parser.add_argument("--swap-times", type=int, default=4, help="batches per swapped step (default: 4)")
    parser.add_argument(
        "--min-numel", type=int, default=256, help="states smaller than this stay on the device (default: 256)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batches")
    parser.add_argument(
        "--step",
        choices=("after_backward", "in_backward"),
        default="after_backward",
        help="SwapConfig.step of the swapped run: in_backward updates each batch inside the backward (both runs "
        "then train without gradient clipping) (default: after_backward)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch ops; default: 1 on the simulator (a small model trains fastest that way, "
        "above all on a busy machine), torch's own default with an accelerator",
    )
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 20 if args.quick else 150
    if args.out is None:
        args.out = Path("out/demo-quick" if args.quick else "out/demo")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.backend is None:
        args.backend = "auto" if torch.accelerator.is_available() else "sim"
    if args.checked and args.backend != "sim":
        parser.error("--checked applies to the simulated accelerator only (--backend sim)")
    if args.threads is None and args.backend == "sim":
        args.threads = 1
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    return args


def build_models(vocab_size: int, seed: int, device: torch.device) -> tuple[CharGPT, CharGPT]:
    """Two models with the same initial weights, one per run."""
    torch.manual_seed(seed)
    initial_weights = CharGPT(vocab_size).state_dict()
    models = []
    for _ in range(2):
        model = CharGPT(vocab_size)
        model.load_state_dict(initial_weights)
        models.append(model.to(device))
    return models[0], models[1]


def write_summary(path: Path, **sections: Any) -> Path:
    path.write_text(json.dumps(sections, indent=2))
    return path


def main() -> int:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    console = Console()
    backend, device = make_backend(args)
    backend_label = describe_backend(backend, device)
    config = SwapConfig(swap_times=args.swap_times, min_numel=args.min_numel, backend=backend, step=args.step)
    corpus = load_corpus()
    plain_model, swapped_model = build_models(len(corpus.alphabet), args.seed, device)
    parameters = sum(p.numel() for p in plain_model.parameters())
    console.print(
        f"corpus: {len(corpus.tokens):,} characters of {corpus.files} files ({corpus.source}), "
        f"{len(corpus.alphabet)} distinct\n"
        f"model: {LAYERS} layers, width {WIDTH}, {HEADS} heads, context {CONTEXT}, {parameters:,} parameters; "
        f"batch {BATCH_SIZE}, {args.steps} steps, CPU threads: {torch.get_num_threads()}\n"
        f"swapped run: SwapConfig(swap_times={args.swap_times}, min_numel={args.min_numel}, step={args.step!r}) on "
        f"{backend_label}{'' if clips(args) else '; no gradient clipping in either run'}"
    )

    columns = (
        TextColumn("{task.description:<14}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as progress:
        plain_optimizer = make_optimizer(plain_model)
        plain = train(plain_model, plain_optimizer, corpus, args, progress, "plain AdamW")
        swapped, swapped_optimizer = run_swapped(swapped_model, corpus, args, config, progress)
    baseline_bytes = state_device_bytes(plain_optimizer)
    trace = trace_one_more_step(swapped_model, swapped_optimizer, corpus, args, config)

    result = parity(plain, swapped, plain_model, swapped_model)
    cross_check = sim_cross_check(swapped)
    console.print(stats_table(swapped_optimizer, baseline_bytes, plain, swapped))
    if cross_check is not None:
        verdict = "match" if cross_check else "[red]DO NOT match[/red]"
        console.print(
            f"simulator cross-check: its max_memory_allocated() and memory_allocated() {verdict} "
            "opt.stats peak and resident bytes at every step"
        )
    if isinstance(backend, SimBackend) and backend.check_races:
        console.print(f"simulator: {len(backend.races)} races")

    args.out.mkdir(parents=True, exist_ok=True)
    plots = {name: args.out / filename for name, filename in PLOTS.items()}
    plot_losses(plain, swapped, result, plots["loss"])
    plot_memory(baseline_bytes, swapped, backend_label, plots["memory"])
    clock = trace_clock(backend, device)
    plot_timeline(trace, args.steps + 1, clock, plots["timeline"], in_backward=args.step == "in_backward")
    summary_path = write_summary(
        args.out / "summary.json",
        backend=backend_label,
        device=str(device),
        steps=args.steps,
        corpus={"characters": len(corpus.tokens), "files": corpus.files, "vocabulary": len(corpus.alphabet)},
        model={"layers": LAYERS, "width": WIDTH, "heads": HEADS, "context": CONTEXT, "parameters": parameters},
        config={
            "swap_times": args.swap_times,
            "min_numel": args.min_numel,
            "step": args.step,
            "clip_norm": CLIP_NORM if clips(args) else None,
            "batch_size": BATCH_SIZE,
            **ADAMW,
        },
        parity=result,
        losses={"plain": plain.losses, "swapped": swapped.losses},
        memory={
            "plain_state_device_bytes": baseline_bytes,
            "swapped_peak_state_device_bytes": swapped.peak_bytes,
            "swapped_resident_state_device_bytes": swapped.resident_bytes,
            "sim_max_memory_allocated": swapped.sim_peak_bytes or None,
            "sim_memory_allocated": swapped.sim_between_bytes or None,
            "sim_cross_check": cross_check,
        },
        last_step_stats=dataclasses.asdict(swapped_optimizer.stats),
        traced_step={"step": args.steps + 1, "intervals": [dataclasses.asdict(span) for span in trace]},
        seconds={"plain_run": plain.seconds, "swapped_run": swapped.seconds},
        plots={name: str(path) for name, path in plots.items()},
    )

    steps = len(plain.losses)
    parameters_verdict = "identical" if result["final_parameters_identical"] else "[red]DIFFERENT[/red]"
    if result["identical"]:
        console.print(
            f"loss parity: identical, {steps}/{steps} steps bitwise equal (max |Δloss| = {result['max_abs_diff']:g}); "
            f"final parameters {parameters_verdict}",
            style="bold green",
        )
    else:
        console.print(f"loss parity: DIFFERENT, max |Δloss| = {result['max_abs_diff']:g}", style="bold red")
    console.print(f"plots: {', '.join(str(path) for path in plots.values())}\nnumbers: {summary_path}")
    return 0 if result["identical"] and result["final_parameters_identical"] and cross_check is not False else 1


if __name__ == "__main__":
    sys.exit(main())
