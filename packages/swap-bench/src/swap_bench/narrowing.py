"""``swap-bench narrowing``: the host time swap-generic's narrowed step adds per batch, measured in one run.

swap-generic runs the wrapped optimizer's own ``step`` once per pipeline batch, with each param group's
``"params"`` narrowed to the batch. What that costs on the host splits in two, and each part is measured
here on the CPU, with every state resident so that no copy takes part:

- **narrowing** (what swap-generic adds): ``GenericAdapter.update`` for every batch of one step, inside its
  ``step_scope``, against the optimizer's own unhooked step run over the same batches by one optimizer per
  batch (the same math on the same tensors, nothing narrowed);
- **splitting** (what torch's step costs per call, whoever calls it): the per-batch optimizers' steps
  against one unhooked step over all parameters;
- **added** (both together, what a swapped step pays per batch on the host over the plain step): the narrowed
  step against the one unhooked step.

All three step the same parameters, gradients and states from clones, so after the run they must agree bit
for bit (``bitwise_equal``): a measurement of paths that compute different things would mean nothing. The
parameters are small (a few hundred elements) so that the math does not drown the host work. Timings are
medians over alternating repeats (paired differences, the garbage collector paused), never pass/fail.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from swap_core import UpdateBatch
from swap_core.errors import AdapterNotFoundError, UnsupportedOptimizerError

from .arguments import command_parser, output_file, positive_count
from .report import SCHEMA, machine_facts, print_skipped, save_json
from .workloads import OPTIMIZERS, OptimizerSpec

__all__ = [
    "NARROWING_OPTIMIZERS",
    "NarrowingConfig",
    "NarrowingRow",
    "measure_narrowing",
    "narrowing_main",
    "narrowing_parser",
]

NARROWING_OPTIMIZERS = ("sgd", "adagrad", "nadam", "adamw8bit")
"""The default rows: swap-generic's optimizers of issue 12 (``adamw8bit``: bitsandbytes, when installed)."""

TARGET_PER_BATCH_S = 5e-6
"""What the narrowed step may add per batch over the plain step (swap-generic's goal, held against
``added_per_batch_s``); shown beside the measurement, never asserted."""


@dataclasses.dataclass(frozen=True)
class NarrowingConfig:
    batches: int = 16
    params_per_batch: int = 2
    numel: int = 256
    """Elements of each fp32 parameter (bitsandbytes' 8-bit states need ``numel >= 4096``; see ``adamw8bit``)."""
    warmup: int = 20
    repeats: int = 200


@dataclasses.dataclass(frozen=True)
class NarrowingRow:
    """One optimizer's host costs per step and per batch; timings are medians of one run."""

    optimizer: str
    optimizer_class: str
    batches: int
    params_per_batch: int
    numel: int
    repeats: int
    full_step_s: float
    """One unhooked step over every parameter."""
    split_step_s: float
    """The unhooked steps of ``batches`` optimizers, one per batch."""
    narrowed_step_s: float
    """swap-generic: ``step_scope`` and ``update`` of every batch over one optimizer."""
    narrowing_per_batch_s: float
    """Median of (narrowed - split) / batches: what swap-generic adds per batch."""
    splitting_per_batch_s: float
    """Median of (split - full) / batches: what one more call of torch's step costs."""
    added_per_batch_s: float
    """Median of (narrowed - full) / batches: what the narrowed step costs per batch over the plain step (both
    parts above; for an optimizer whose per-instance cost makes ``split`` slow, e.g. bitsandbytes', the one
    that holds)."""
    bitwise_equal: bool
    """Whether the three paths' parameters and states agree bit for bit after the run."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def measure_narrowing(spec: OptimizerSpec, config: NarrowingConfig = NarrowingConfig()) -> NarrowingRow:
    """Measure ``spec``'s optimizer over ``config``'s parameters (needs swap-generic)."""
    from swap_generic.torch_compat import unhooked_step

    size = config.params_per_batch
    full_params, split_params, narrowed_params = (_params(config) for _ in range(3))
    full = spec.build(full_params)
    split = [spec.build(split_params[j * size : (j + 1) * size]) for j in range(config.batches)]
    narrowed = spec.build(narrowed_params)
    narrowed_step = _NarrowedStep(narrowed, [narrowed_params[j * size : (j + 1) * size] for j in range(config.batches)])
    full_step = unhooked_step(full)
    split_steps = [unhooked_step(optimizer) for optimizer in split]

    def step_split() -> None:
        for step in split_steps:
            step()

    for _ in range(config.warmup):
        full_step()
        step_split()
        narrowed_step.run(narrowed_step.batches())  # the first step creates the states
    # The state dicts stay the same objects from now on: the batches are built once, outside the timings.
    ready = narrowed_step.batches()
    full_times, split_times, narrowed_times = _alternated_timings(
        (full_step, step_split, lambda: narrowed_step.run(ready)), config.repeats
    )
    return NarrowingRow(
        optimizer=spec.name,
        optimizer_class=type(full).__name__,
        batches=config.batches,
        params_per_batch=size,
        numel=config.numel,
        repeats=config.repeats,
        full_step_s=statistics.median(full_times),
        split_step_s=statistics.median(split_times),
        narrowed_step_s=statistics.median(narrowed_times),
        narrowing_per_batch_s=_per_batch(narrowed_times, split_times, config.batches),
        splitting_per_batch_s=_per_batch(split_times, full_times, config.batches),
        added_per_batch_s=_per_batch(narrowed_times, full_times, config.batches),
        bitwise_equal=_agree(full, split, narrowed, full_params, split_params, narrowed_params),
    )


class _NarrowedStep:
    """swap-generic's narrowed step over one optimizer, as swap-core runs it: ``GenericAdapter.update`` of every
    batch inside its ``step_scope``."""

    def __init__(self, optimizer: torch.optim.Optimizer, shares: list[list[torch.Tensor]]) -> None:
        from swap_generic import GenericAdapter

        self._optimizer = optimizer
        self._adapter = GenericAdapter(optimizer)
        self._group = optimizer.param_groups[0]
        self._shares = shares
        """Each batch's parameters."""

    def batches(self) -> list[UpdateBatch]:
        """As swap-core hands them over: each batch's parameters, gradients and current state dicts."""
        state = self._optimizer.state
        return [
            UpdateBatch(self._group, share, list(map(_grad, share)), [state[p] for p in share], index)
            for index, share in enumerate(self._shares)
        ]

    def run(self, ready: Sequence[UpdateBatch]) -> None:
        """One narrowed step over the batches ``ready``."""
        with self._adapter.step_scope():
            for batch in ready:
                self._adapter.update(batch)


def _per_batch(slower: Sequence[float], faster: Sequence[float], batches: int) -> float:
    """The median over the repeats of the time ``slower`` took beyond ``faster`` (paired), per batch."""
    return statistics.median((s - f) / batches for s, f in zip(slower, faster, strict=True))


def _alternated_timings(steps: Sequence[Callable[[], object]], repeats: int) -> list[list[float]]:
    """The seconds of each of ``steps``, ``repeats`` times, one after the other in turn (so drifting machine load
    hits all alike), with the garbage collector off."""
    times: list[list[float]] = [[] for _ in steps]
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for step, seconds in zip(steps, times, strict=True):
                seconds.append(_timed(step))
    finally:
        if collecting:
            gc.enable()
    return times


def _params(config: NarrowingConfig) -> list[torch.Tensor]:
    """The same values each call: parameters with fixed gradients."""
    generator = torch.Generator().manual_seed(0)
    params: list[torch.Tensor] = []
    for _ in range(config.batches * config.params_per_batch):
        param = torch.nn.Parameter(torch.randn(config.numel, generator=generator))
        param.grad = torch.randn(config.numel, generator=generator)
        params.append(param)
    return params


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None, "every parameter here has its fixed gradient"
    return param.grad


def _timed(function: Callable[[], object]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def _agree(
    full: torch.optim.Optimizer,
    split: Sequence[torch.optim.Optimizer],
    narrowed: torch.optim.Optimizer,
    full_params: Sequence[torch.Tensor],
    split_params: Sequence[torch.Tensor],
    narrowed_params: Sequence[torch.Tensor],
) -> bool:
    split_state = {param: state for optimizer in split for param, state in optimizer.state.items()}
    for one, two, three in zip(full_params, split_params, narrowed_params, strict=True):
        if not (torch.equal(one, two) and torch.equal(one, three)):
            return False
        states = (full.state[one], split_state[two], narrowed.state[three])
        if not states[0].keys() == states[1].keys() == states[2].keys():
            return False
        for key, value in states[0].items():
            others = (states[1][key], states[2][key])
            if isinstance(value, torch.Tensor):
                if not all(isinstance(o, torch.Tensor) and torch.equal(value, o) for o in others):
                    return False
            elif not all(o == value for o in others):
                return False
    return True


def narrowing_main(argv: Sequence[str] | None = None) -> int:
    """The ``swap-bench narrowing`` command: measure, print the table, write the JSON report."""
    parser = narrowing_parser()
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = NarrowingConfig(
        batches=args.batches,
        params_per_batch=args.params_per_batch,
        numel=args.numel,
        warmup=2 if args.quick else NarrowingConfig.warmup,
        repeats=3 if args.quick else args.repeats,
    )
    console = Console(width=None if Console().is_terminal else 160)
    rows: list[NarrowingRow] = []
    skipped: list[dict[str, str]] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("narrowing", total=len(args.optimizers))
        for name in args.optimizers:
            progress.update(task, description=f"narrowing {name}")
            try:
                rows.append(measure_narrowing(OPTIMIZERS[name], config))
            except (AdapterNotFoundError, UnsupportedOptimizerError, ModuleNotFoundError) as error:
                skipped.append({"row": f"narrowing {name}", "reason": str(error).splitlines()[0]})
            progress.advance(task)
    console.print(_table(rows, config))
    print_skipped(skipped, console)
    document: dict[str, Any] = {
        "schema": SCHEMA,
        "kind": "narrowing",
        "machine": {**machine_facts(), "threads": args.threads},
        "config": dataclasses.asdict(config),
        "rows": [],
        "skipped": skipped,
        "comparisons": [],
        "modeled_rows": [],
        "narrowing_rows": [row.as_dict() for row in rows],
        "iteration_rows": [],
        "device_perf_rows": [],
    }
    console.print(f"JSON report: {save_json(document, args.json)}")
    return 0 if all(row.bitwise_equal for row in rows) else 1


def narrowing_parser() -> argparse.ArgumentParser:
    """The parser of ``swap-bench narrowing``."""
    parser = command_parser(
        "swap-bench narrowing",
        "The host time swap-generic adds per batch when it runs an optimizer's own step over one batch's\n"
        "share of its param groups (narrowed), against the plain step over all parameters, on the CPU.",
    )
    parser.add_argument(
        "--optimizers",
        nargs="+",
        default=list(NARROWING_OPTIMIZERS),
        choices=sorted(OPTIMIZERS),
        help="optimizers measured",
    )
    parser.add_argument(
        "--batches", type=positive_count, default=NarrowingConfig.batches, help="pipeline batches per step"
    )
    parser.add_argument(
        "--params-per-batch", type=positive_count, default=NarrowingConfig.params_per_batch, help="parameters per batch"
    )
    parser.add_argument("--numel", type=positive_count, default=NarrowingConfig.numel, help="elements per parameter")
    parser.add_argument("--repeats", type=positive_count, default=NarrowingConfig.repeats, help="timed steps")
    parser.add_argument("--quick", action="store_true", help="a few repeats: a smoke run (schema, bitwise check)")
    parser.add_argument("--threads", type=positive_count, default=1, help="torch CPU threads")
    parser.add_argument(
        "--json", type=output_file, default="swap-bench-narrowing.json", help="where to write the JSON report"
    )
    return parser


def _table(rows: Sequence[NarrowingRow], config: NarrowingConfig) -> Table:
    table = Table(
        title=f"swap-generic's narrowed step: {config.batches} batches of {config.params_per_batch} x "
        f"{config.numel} fp32, host time (medians, CPU, states resident)"
    )
    columns = ("optimizer", "full µs", "split µs", "narrowed µs", "splitting µs/batch", "narrowing µs/batch")
    for column in (*columns, "added µs/batch"):
        table.add_column(column, justify="left" if column == "optimizer" else "right")
    table.add_column(f"≤ {TARGET_PER_BATCH_S * 1e6:.0f} µs")
    table.add_column("bitwise")
    for row in rows:
        table.add_row(
            row.optimizer_class,
            f"{row.full_step_s * 1e6:.1f}",
            f"{row.split_step_s * 1e6:.1f}",
            f"{row.narrowed_step_s * 1e6:.1f}",
            f"{row.splitting_per_batch_s * 1e6:.2f}",
            f"{row.narrowing_per_batch_s * 1e6:.2f}",
            f"{row.added_per_batch_s * 1e6:.2f}",
            "yes" if row.added_per_batch_s <= TARGET_PER_BATCH_S else "no",
            "yes" if row.bitwise_equal else "[red]NO[/]",
        )
    return table
