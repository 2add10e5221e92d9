"""One row of ``swap-bench device-perf``, measured in a process of its own (``python -m swap_bench.perf_rows
REQUEST.json RESULT.json``), so that no row inherits another's device memory, pinned host memory or hooks.

- ``plan`` (:func:`measure_plan`): the raw pinned copies (:func:`~swap_bench.link.measure_link`: each way alone and
  both at once), the device's free memory, the model fitted to it, a forward and a backward of it timed at a probe
  token count with the memory their activations take, and from those the tokens of the other rows
  (:mod:`swap_bench.perf_sizing`).
- a training row (:func:`measure_training_row`): the bf16 :class:`~swap_bench.decoder.Decoder` trained with AdamW
  over fp32 masters on the device (the plain optimizer, :class:`MastersOnDevice`), alternated iteration by iteration
  with a copy of it trained another way: AdamW swapped with ``SwapConfig(master_weights=True, trace=True)``, stepping
  after the backward (``after_backward``) or inside it (``in_backward``), or torchao's ``CPUOffloadOptimizer``
  (``torchao``). An iteration is the forward, the backward, ``step()`` and ``zero_grad()``, timed from an idle device
  to an idle device; a swapped iteration begins with ``prefetch()``, so that its first copy-in runs under the forward.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from swap_core import DeviceBackend, SwapConfig, SwapOptimizer, swap_optimizer

from .bench_backend import bench_backend
from .comparisons import BASELINES
from .decoder import Decoder, token_batch
from .iteration import StepPlace
from .link import LinkBandwidth, measure_link
from .measure import BaselineOptimizer, _alternated, _max_abs_diff, _paired_median_difference, optimizer_state_bytes
from .models import ModelShape
from .perf_sizing import fitted_shape, plan_tokens, row_device_bytes, transfer_seconds
from .workloads import OPTIMIZERS

__all__ = [
    "ROW_KINDS",
    "MastersOnDevice",
    "PerfSettings",
    "RowSkipped",
    "TrainingPlan",
    "TrainingRow",
    "main",
    "measure_plan",
    "measure_training_row",
]

ROW_KINDS = ("after_backward", "in_backward", "torchao")
"""What a training row holds against the plain optimizer."""

PROBE_REPEATS = 3
"""Forward-and-backward passes timed at the probe token count (after one that warms up): their median counts."""


class RowSkipped(Exception):
    """A row that cannot run here, for the reason given (torchao cannot be imported, say)."""


@dataclasses.dataclass(frozen=True)
class PerfSettings:
    """What every row of one run shares."""

    shape: ModelShape
    """The model before it is fitted to the device's memory."""
    seq_len: int
    probe_tokens: int
    """Tokens of the forward and backward the plan times."""
    max_tokens: int
    """The most tokens an iteration may take."""
    swap_times: int
    warmup: int
    """Iterations of each optimizer before the timed ones (two at least: the first creates the states)."""
    repeats: int
    """Timed iterations of each optimizer, alternated."""
    link_bytes: int
    """Bytes of each raw pinned copy."""
    device_memory: int | None = None
    """The free device memory to size for where the backend cannot tell (the simulator)."""
    threads: int | None = None
    """torch's CPU threads (``None``: torch's own choice)."""
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PerfSettings:
        return cls(**{**data, "shape": ModelShape(**data["shape"])})


@dataclasses.dataclass(frozen=True)
class TrainingPlan:
    """The model fitted to the device, the raw link, and the tokens of the long and the short rows."""

    shape: ModelShape
    params: int
    device: dict[str, Any]
    """The device as its process saw it (name, memory, multiprocessors)."""
    free_device_bytes: int
    row_device_bytes: int
    """What each training row's process holds besides activations (:func:`~swap_bench.perf_sizing.row_device_bytes`)."""
    link: LinkBandwidth
    probe_tokens: int
    forward_seconds_per_token: float
    backward_seconds_per_token: float
    activation_bytes_per_token: float
    """Peak device bytes of one iteration's activations per token (0 on the simulator, which does not count them)."""
    transfer_seconds: float
    """Every swapped byte in and out once at the raw rates (:func:`~swap_bench.perf_sizing.transfer_seconds`)."""
    tokens_long: int
    tokens_short: int

    def to_json(self) -> dict[str, Any]:
        document = dataclasses.asdict(self)
        document["backward_long_seconds"] = self.backward_seconds_per_token * self.tokens_long
        document["backward_short_seconds"] = self.backward_seconds_per_token * self.tokens_short
        return document

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainingPlan:
        known = {field.name for field in dataclasses.fields(cls)}
        fields = {key: value for key, value in data.items() if key in known}
        return cls(**{**fields, "shape": ModelShape(**data["shape"]), "link": LinkBandwidth(**data["link"])})


@dataclasses.dataclass(frozen=True)
class TrainingRow:
    """One training row: the plain optimizer and another, alternated; times are medians of the timed iterations."""

    name: str
    optimizer: str
    """One of :data:`ROW_KINDS`."""
    tokens: int
    sequences: int
    params: int
    plain_iteration_s: float
    iteration_s: float
    ratio: float
    """``iteration_s / plain_iteration_s``."""
    added_s: float
    """The median over the pairs of (this iteration - the plain one timed just before it)."""
    backward_s: float
    """One backward of the plain model over these tokens, timed once after the warm-up: what a step inside the
    backward can hide its copies under."""
    plain_state_device_bytes: int
    """The plain optimizer's masters, their gradients and moments on the device."""
    bitwise_equal: bool
    """Whether every parameter equals the plain model's after the same iterations."""
    max_abs_diff: float | None
    swap_times: int | None = None
    link_bytes_per_second: float | None = None
    """The median over the timed iterations of ``opt.stats.link_bytes_per_second`` (swapped rows)."""
    link_fraction_of_raw: float | None = None
    """``link_bytes_per_second`` over the raw rate of copies both ways at once, measured by the plan."""
    h2d_bytes: int | None = None
    d2h_bytes: int | None = None
    h2d_copies: int | None = None
    d2h_copies: int | None = None
    batches: int | None = None
    batches_in_backward: int | None = None
    peak_state_device_bytes: int | None = None
    host_pinned_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class MastersOnDevice:
    """The plain optimizer of a bf16 model: AdamW over fp32 copies of the parameters (the masters), on the device.

    :meth:`step` upcasts the gradients to the masters, steps, and sets the parameters from the masters; the math
    ``SwapConfig(master_weights=True)`` runs, without swapping (swap-core's conformance suite holds the two bitwise
    equal).
    """

    def __init__(
        self, params: Sequence[torch.nn.Parameter], build: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    ) -> None:
        self.params = list(params)
        self.masters = [param.detach().float().requires_grad_(param.requires_grad) for param in self.params]
        self.optimizer = build(self.masters)

    @torch.no_grad()
    def step(self) -> None:
        for param, master in zip(self.params, self.masters, strict=True):
            master.grad = None if param.grad is None else param.grad.float()
        self.optimizer.step()
        for param, master in zip(self.params, self.masters, strict=True):
            param.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for tensor in (*self.params, *self.masters):
            tensor.grad = None

    @property
    def state_device_bytes(self) -> int:
        """The masters, their gradients (made at each step) and the moments."""
        masters = sum(master.numel() * master.element_size() for master in self.masters)
        return 2 * masters + optimizer_state_bytes(self.optimizer)


def measure_plan(settings: PerfSettings, backend_name: str) -> TrainingPlan:
    """The ``plan`` row: link, free memory, fitted model, probe, tokens (see the module)."""
    backend = bench_backend(backend_name)[2]()
    free = backend.available_device_bytes() or settings.device_memory
    if free is None:
        raise ValueError(f"the {backend_name} backend cannot tell its free memory: give --device-memory")
    link = measure_link(backend, settings.link_bytes)
    shape = fitted_shape(settings.shape, free, settings.swap_times)
    model = _decoder(shape, backend, settings.seed)
    sequences = max(settings.probe_tokens // settings.seq_len, 1)
    tokens = token_batch(shape.vocab_size, sequences, settings.seq_len, backend.device, settings.seed)
    forward_s, backward_s, activation_bytes = _probe(model, tokens, backend)
    fixed = row_device_bytes(shape.numel, settings.swap_times)
    transfer_s = transfer_seconds(shape.numel, link)
    count = tokens.numel()
    long_tokens, short_tokens = plan_tokens(
        transfer_s=transfer_s,
        backward_s_per_token=backward_s / count,
        activation_bytes_per_token=activation_bytes / count,
        spare_bytes=free - fixed,
        seq_len=settings.seq_len,
        max_tokens=settings.max_tokens,
    )
    return TrainingPlan(
        shape=shape,
        params=shape.numel,
        device=_device_properties(backend_name),
        free_device_bytes=free,
        row_device_bytes=fixed,
        link=link,
        probe_tokens=count,
        forward_seconds_per_token=forward_s / count,
        backward_seconds_per_token=backward_s / count,
        activation_bytes_per_token=activation_bytes / count,
        transfer_seconds=transfer_s,
        tokens_long=long_tokens,
        tokens_short=short_tokens,
    )


def _decoder(shape: ModelShape, backend: DeviceBackend, seed: int) -> Decoder:
    """``shape``'s decoder in bf16 on ``backend``'s device, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    with torch.device(backend.device):
        return Decoder(shape).to(torch.bfloat16)


def _probe(model: Decoder, tokens: torch.Tensor, backend: DeviceBackend) -> tuple[float, float, int]:
    """Median seconds of a forward and of a backward over ``tokens``, and the peak device bytes their activations
    took (the gradients already allocated by a first pass, which warms up too)."""
    model(tokens).backward()
    backend.synchronize()
    before = backend.memory_allocated()
    backend.reset_peak_memory_stats()
    forward, backward = [], []
    for _ in range(PROBE_REPEATS):
        started = time.perf_counter()
        loss = model(tokens)
        backend.synchronize()
        middle = time.perf_counter()
        loss.backward()
        backend.synchronize()
        forward.append(middle - started)
        backward.append(time.perf_counter() - middle)
    activations = max(backend.max_memory_allocated() - before, 0)
    return statistics.median(forward), statistics.median(backward), activations


def _device_properties(backend_name: str) -> dict[str, Any]:
    """The device's name, memory and multiprocessors as torch's device module reports them."""
    if backend_name == "sim":
        return {"name": "SimBackend (CPU memory)"}
    module = torch.get_device_module(backend_name)
    properties = module.get_device_properties(module.current_device())
    return {
        "name": getattr(properties, "name", None),
        "total_memory_bytes": getattr(properties, "total_memory", None),
        "multiprocessors": getattr(properties, "multi_processor_count", None),
        "capability": f"{properties.major}.{properties.minor}" if hasattr(properties, "major") else None,
    }


def measure_training_row(
    name: str, kind: str, tokens: int, settings: PerfSettings, plan: TrainingPlan, backend_name: str
) -> TrainingRow:
    """The plain optimizer against ``kind`` (one of :data:`ROW_KINDS`) over ``tokens`` tokens an iteration."""
    backend = bench_backend(backend_name)[2]()
    plain_model = _decoder(plan.shape, backend, settings.seed)
    model = copy.deepcopy(plain_model)
    sequences = max(tokens // settings.seq_len, 1)
    batch = token_batch(plan.shape.vocab_size, sequences, settings.seq_len, backend.device, settings.seed)
    plain = MastersOnDevice(list(plain_model.parameters()), OPTIMIZERS["adamw"].build)
    compared = _compared(kind, model, backend, settings.swap_times)
    rates: list[float | None] = []
    iterations = (
        _iteration(plain_model, batch, plain),
        _iteration(model, batch, compared, after=lambda: rates.append(_link_rate(compared))),
    )
    for _ in range(max(settings.warmup, 2)):
        for iteration in iterations:
            iteration()
    backward_s = _timed_backward(plain_model, batch, plain, backend)
    rates.clear()
    plain_times, times = _alternated(iterations, backend, settings.repeats)
    backend.synchronize()
    plain_params, params = list(plain_model.parameters()), list(model.parameters())
    bitwise = all(torch.equal(left, right) for left, right in zip(plain_params, params, strict=True))
    plain_s, compared_s = statistics.median(plain_times), statistics.median(times)
    swapped = _swapped_figures(compared, rates, plan.link)
    return TrainingRow(
        name=name,
        optimizer=kind,
        tokens=batch.numel(),
        sequences=sequences,
        params=plan.params,
        plain_iteration_s=plain_s,
        iteration_s=compared_s,
        ratio=compared_s / plain_s,
        added_s=_paired_median_difference(times, plain_times),
        backward_s=backward_s,
        plain_state_device_bytes=plain.state_device_bytes,
        bitwise_equal=bitwise,
        max_abs_diff=0.0 if bitwise else _max_abs_diff(plain_params, params),
        **swapped,
    )


def _timed_backward(model: Decoder, tokens: torch.Tensor, plain: MastersOnDevice, backend: DeviceBackend) -> float:
    """Seconds of one backward of ``model`` over ``tokens`` (its gradients then dropped: no step follows)."""
    loss = model(tokens)
    backend.synchronize()
    started = time.perf_counter()
    loss.backward()
    backend.synchronize()
    seconds = time.perf_counter() - started
    plain.zero_grad()
    return seconds


def _compared(kind: str, model: Decoder, backend: DeviceBackend, swap_times: int) -> BaselineOptimizer:
    """The optimizer of ``model`` that the plain one is held against."""
    params = list(model.parameters())
    if kind == "torchao":
        try:
            return BASELINES["torchao"].build(params, backend)
        except ImportError as error:
            raise RowSkipped(f"torchao could not be imported: {error}") from error
    if kind not in ROW_KINDS:
        raise ValueError(f"Unknown device-perf row kind {kind!r}; kinds are {ROW_KINDS}")
    step: StepPlace = "in_backward" if kind == "in_backward" else "after_backward"
    config = SwapConfig(backend=backend, swap_times=swap_times, master_weights=True, step=step, trace=True)
    return swap_optimizer(OPTIMIZERS["adamw"].build(params), config)


def _iteration(
    model: Decoder, tokens: torch.Tensor, optimizer: BaselineOptimizer, *, after: Callable[[], None] | None = None
) -> Callable[[], None]:
    """One training iteration of ``model`` with ``optimizer`` (a swapped one prefetches its first batch first)."""

    def iteration() -> None:
        if isinstance(optimizer, SwapOptimizer):
            optimizer.prefetch()
        model(tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after is not None:
            after()

    return iteration


def _link_rate(optimizer: BaselineOptimizer) -> float | None:
    return optimizer.stats.link_bytes_per_second if isinstance(optimizer, SwapOptimizer) else None


def _swapped_figures(optimizer: BaselineOptimizer, rates: list[float | None], link: LinkBandwidth) -> dict[str, Any]:
    """A swapped row's copies and memory (its last step's ``opt.stats``), and the median link rate of its timed
    iterations against the raw rate of both directions at once; nothing for another optimizer."""
    if not isinstance(optimizer, SwapOptimizer):
        return {}
    stats = optimizer.stats
    measured = [rate for rate in rates if rate is not None]
    rate = statistics.median(measured) if measured and len(measured) == len(rates) else None
    return {
        "swap_times": optimizer.config.swap_times,
        "link_bytes_per_second": rate,
        "link_fraction_of_raw": None if rate is None else rate / link.duplex,
        "h2d_bytes": stats.h2d_bytes,
        "d2h_bytes": stats.d2h_bytes,
        "h2d_copies": stats.h2d_copies,
        "d2h_copies": stats.d2h_copies,
        "batches": stats.batches,
        "batches_in_backward": stats.batches_in_backward,
        "peak_state_device_bytes": stats.peak_state_device_bytes,
        "host_pinned_bytes": stats.host_pinned_bytes,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Measure the row a request file asks for and write its result file: ``{"plan": ...}``, ``{"row": ...}`` or
    ``{"skipped": reason}``. An error propagates (the parent process reports the row as failed, with its output)."""
    request_path, result_path = list(sys.argv[1:] if argv is None else argv)
    request: dict[str, Any] = json.loads(Path(request_path).read_text())
    settings = PerfSettings.from_json(request["settings"])
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    backend_name = request["backend"]
    result: dict[str, Any]
    try:
        if request["kind"] == "plan":
            result = {"plan": measure_plan(settings, backend_name).to_json()}
        else:
            plan = TrainingPlan.from_json(request["plan"])
            row = measure_training_row(
                request["name"], request["kind"], request["tokens"], settings, plan, backend_name
            )
            result = {"row": row.as_dict()}
    except RowSkipped as skipped:
        result = {"skipped": str(skipped)}
    Path(result_path).write_text(json.dumps(result, indent=2, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
