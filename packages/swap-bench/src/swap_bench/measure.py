"""One benchmark row: the unswapped optimizer and another one (swapped, or an external baseline), stepped alternately.

The other one is the swapped optimizer (:func:`measure_row`) or, for comparison rows, an external offloading
baseline built by a factory (:func:`measure_comparison`), so that any stand-in can be measured on the simulator.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from swap_core import DeviceBackend, SwapConfig, SwapOptimizer, SwapStats, swap_optimizer
from swap_core.views import planned_batches

from .link import LinkBandwidth
from .workloads import OPTIMIZERS, OptimizerSpec, Workload

__all__ = [
    "BaselineFactory",
    "BaselineOptimizer",
    "ComparisonResult",
    "RowConfig",
    "RowResult",
    "measure_comparison",
    "measure_row",
    "optimizer_state_bytes",
]


@dataclasses.dataclass(frozen=True)
class RowConfig:
    workload: Workload
    optimizer: OptimizerSpec
    swap_times: int
    packed: bool
    duplex: bool

    @property
    def label(self) -> str:
        layout = ("packed" if self.packed else "per-tensor") + ("" if self.duplex else ", 1 stream")
        return f"{self.workload.name} {self.optimizer.name} k={self.swap_times} {layout}"


@dataclasses.dataclass(frozen=True)
class RowResult:
    """Everything one row reports; timings are medians over the measured steps."""

    workload: str
    optimizer: str
    swap_times: int
    packed: bool
    duplex: bool
    params: int
    plain_step_s: float
    swapped_step_s: float
    ratio: float
    swapped_state_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    h2d_copies: int
    d2h_copies: int
    batches: int
    achieved_gbps: float
    added_s: float
    """Median over the alternating pairs of (swapped step - the plain step just before it): what swapping added."""
    copy_floor_s: float
    copy_floor_efficiency: float | None
    """Copy floor over ``added_s``; ``None`` when swapping added nothing (copies hidden, or noise)."""
    copies_alone_s: float
    """Median time of the step's own copies without the optimizer (same sizes and order), timed between steps."""
    overhead_per_batch_s: float | None
    """``(added_s - copies_alone_s) / batches``: what swapping adds per batch beyond its copies (host work of the
    runtime and the adapter, e.g. swap-generic's narrowed step); ``None`` where swapping added less than its copies
    take alone, because the step hid them under its updates (a large workload) or the two medians are within noise:
    no overhead beyond the copies can be told apart then."""
    ideal_step_s: float
    ideal_percent: float
    peak_state_device_bytes_swapped: int
    peak_state_device_bytes_unswapped: int
    host_state_bytes: int
    """Host bytes the swapped states need."""
    host_pinned_bytes: int
    """Host bytes really pinned for them, rounding included (``SwapConfig.host_memory``)."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def measure_row(
    row: RowConfig,
    backend_factory: Callable[[], DeviceBackend],
    link: LinkBandwidth,
    *,
    warmup: int,
    repeats: int,
) -> RowResult:
    backend = backend_factory()
    plain_params, plain, swapped = _warmed_pair(row, backend, warmup)
    plain_times, swapped_times, floor_times = _alternated_with_copies_alone(plain, swapped, backend, repeats)
    stats = swapped.stats
    plain_s, swapped_s = statistics.median(plain_times), statistics.median(swapped_times)
    floor_s = stats.h2d_bytes / link.h2d + stats.d2h_bytes / link.d2h
    copies_alone_s = statistics.median(floor_times)
    added_s = _paired_median_difference(swapped_times, plain_times)
    ideal_s = _ideal_step_seconds(stats, link, plain_s)
    return RowResult(
        workload=row.workload.name,
        optimizer=row.optimizer.name,
        swap_times=row.swap_times,
        packed=row.packed,
        duplex=row.duplex,
        params=sum(p.numel() for p in plain_params),
        plain_step_s=plain_s,
        swapped_step_s=swapped_s,
        ratio=swapped_s / plain_s,
        swapped_state_bytes=stats.h2d_bytes,
        h2d_bytes=stats.h2d_bytes,
        d2h_bytes=stats.d2h_bytes,
        h2d_copies=stats.h2d_copies,
        d2h_copies=stats.d2h_copies,
        batches=stats.batches,
        achieved_gbps=(stats.h2d_bytes + stats.d2h_bytes) / swapped_s / 1e9,
        added_s=added_s,
        copy_floor_s=floor_s,
        copy_floor_efficiency=floor_s / added_s if added_s > 0 else None,
        copies_alone_s=copies_alone_s,
        overhead_per_batch_s=(added_s - copies_alone_s) / max(stats.batches, 1) if added_s >= copies_alone_s else None,
        ideal_step_s=ideal_s,
        ideal_percent=100.0 * ideal_s / swapped_s,
        peak_state_device_bytes_swapped=stats.peak_state_device_bytes,
        peak_state_device_bytes_unswapped=optimizer_state_bytes(plain),
        host_state_bytes=stats.host_state_bytes,
        host_pinned_bytes=stats.host_pinned_bytes,
    )


def _alternated_with_copies_alone(
    plain: torch.optim.Optimizer, swapped: SwapOptimizer, backend: DeviceBackend, repeats: int
) -> list[list[float]]:
    """The seconds of the plain step, the swapped step and the swapped step's copies alone (:class:`_CopiesAlone`),
    each timed ``repeats`` times, in turn."""
    sizes = _transfer_sizes(swapped)
    if sum(map(sum, sizes)) != swapped.stats.h2d_bytes:
        raise AssertionError(
            f"the copies alone would move {sum(map(sum, sizes))} bytes, the step {swapped.stats.h2d_bytes}"
        )
    copies_alone = _CopiesAlone(backend, sizes)
    times = _alternated((plain.step, swapped.step, copies_alone.copy), backend, repeats)
    copies_alone.release()
    return times


def _paired_median_difference(slower: Sequence[float], faster: Sequence[float]) -> float:
    """The median of ``slower[i] - faster[i]``. Each swapped step is paired with the plain step timed just before
    it: load that drifts over the run cancels out of the differences, which the difference of the two medians does
    not do."""
    return statistics.median(s - f for s, f in zip(slower, faster, strict=True))


def _ideal_step_seconds(stats: SwapStats, link: LinkBandwidth, plain_s: float) -> float:
    """The step of the performance model (docs/architecture.md): each direction's bytes over its link bandwidth, the
    larger times ``1 + 1/k``, plus ``T_c/k`` (``k`` the batches, ``T_c`` the plain step)."""
    return max(stats.h2d_bytes / link.h2d, stats.d2h_bytes / link.d2h) * (1 + 1 / stats.batches) + (
        plain_s / stats.batches
    )


def _alternated(steps: Sequence[Callable[[], object]], backend: DeviceBackend, repeats: int) -> list[list[float]]:
    """Each of ``steps`` timed ``repeats`` times, in turn, so that machine load that drifts hits all of them alike."""
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for timings, step in zip(times, steps, strict=True):
            timings.append(_timed(step, backend))
    return times


def _warmed_pair(
    row: RowConfig, backend: DeviceBackend, warmup: int
) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, SwapOptimizer]:
    """The plain optimizer's parameters, the plain optimizer and the swapped one of ``row``, on identical parameters
    with the same gradients, after ``warmup`` steps (two at least)."""
    device = backend.device
    plain_params = [p for p in row.workload.make_params(device) if row.optimizer.accepts(p)]
    swapped_params = [p for p in row.workload.make_params(device) if row.optimizer.accepts(p)]
    grads = row.workload.make_grads(plain_params)
    for params in (plain_params, swapped_params):
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()
    plain = row.optimizer.build(plain_params)
    config = SwapConfig(swap_times=row.swap_times, packed=row.packed, duplex=row.duplex, backend=backend)
    swapped = swap_optimizer(row.optimizer.build(swapped_params), config)
    # Two steps at least: an optimizer whose own step creates its states (swap-generic) moves none in its first.
    for _ in range(max(warmup, 2)):
        plain.step()
        swapped.step()
    return plain_params, plain, swapped


class BaselineOptimizer(Protocol):
    """What a comparison row steps: the part of ``torch.optim.Optimizer`` a training loop calls."""

    def step(self) -> object: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


BaselineFactory = Callable[[list[torch.nn.Parameter], DeviceBackend], BaselineOptimizer]
"""Builds a baseline AdamW that updates the given device parameters in place (the backend is theirs)."""


@dataclasses.dataclass(frozen=True)
class ComparisonResult:
    """One comparison row: plain AdamW against an external offloading baseline; timings are medians."""

    workload: str
    optimizer: str
    """Always ``"adamw"``: the plain, on-device ``torch.optim.AdamW`` the baseline is held to."""
    baseline: str
    params: int
    steps: int
    """Steps each optimizer took (warm-up and measured) before their parameters were compared."""
    plain_step_s: float
    """Median of: gradients delivered through autograd, then ``step()``; see :func:`measure_comparison`."""
    baseline_step_s: float
    ratio: float
    """``baseline_step_s / plain_step_s``."""
    bitwise_equal: bool
    """Whether every parameter equals plain AdamW's bit for bit after ``steps`` steps."""
    max_abs_diff: float | None
    """Largest absolute difference from plain AdamW's parameters after ``steps`` steps (0.0 when bitwise equal;
    ``None`` when it is not finite: a NaN or infinity on either side)."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def measure_comparison(
    workload: Workload,
    baseline: str,
    baseline_factory: BaselineFactory,
    backend_factory: Callable[[], DeviceBackend],
    *,
    warmup: int,
    repeats: int,
) -> ComparisonResult:
    """Plain AdamW and the baseline ``baseline_factory`` builds, stepped alternately on the same gradients.

    One step of either is: ``zero_grad(set_to_none=True)``, the workload's fixed gradients delivered with
    ``torch.autograd.backward(params, grads)`` (so that hooks a baseline registers on gradient accumulation run,
    as in a real backward; torchao copies gradients to the host there), then ``step()``; the timer brackets all
    three, between device synchronizations. Results are compared, never asserted: CPU Adam kernels round
    differently from the device's.
    """
    backend = backend_factory()
    plain_params = workload.make_params(backend.device)
    baseline_params = workload.make_params(backend.device)
    grads = workload.make_grads(plain_params)
    plain = OPTIMIZERS["adamw"].build(plain_params)
    other = baseline_factory(baseline_params, backend)

    def plain_step() -> None:
        _backward_and_step(plain, plain_params, grads)

    def baseline_step() -> None:
        _backward_and_step(other, baseline_params, grads)

    for _ in range(warmup):
        plain_step()
        baseline_step()
    plain_times, baseline_times = _alternated((plain_step, baseline_step), backend, repeats)
    plain_s, baseline_s = statistics.median(plain_times), statistics.median(baseline_times)
    bitwise_equal = all(torch.equal(a, b) for a, b in zip(plain_params, baseline_params, strict=True))
    return ComparisonResult(
        workload=workload.name,
        optimizer="adamw",
        baseline=baseline,
        params=sum(p.numel() for p in plain_params),
        steps=warmup + repeats,
        plain_step_s=plain_s,
        baseline_step_s=baseline_s,
        ratio=baseline_s / plain_s,
        bitwise_equal=bitwise_equal,
        max_abs_diff=0.0 if bitwise_equal else _max_abs_diff(plain_params, baseline_params),
    )


def _backward_and_step(
    optimizer: BaselineOptimizer, params: list[torch.nn.Parameter], grads: list[torch.Tensor]
) -> None:
    optimizer.zero_grad(set_to_none=True)
    torch.autograd.backward(params, grad_tensors=grads)
    optimizer.step()


def _max_abs_diff(left: list[torch.nn.Parameter], right: list[torch.nn.Parameter]) -> float | None:
    with torch.no_grad():
        diffs = [(a.double() - b.double()).abs().max().item() for a, b in zip(left, right, strict=True)]
    return max(diffs) if all(math.isfinite(diff) for diff in diffs) else None


class _CopiesAlone:
    """The swapped step's own copies without the optimizer: per batch, its transfers in, then out.

    The same copy sizes in the same order as the step (host regions in turn, two alternating device
    regions like the staging arenas), timed between the steps. Informational beside the copy floor
    (bytes over the link bandwidth): on the simulator a batch that fits the CPU caches copies back out
    faster than the link figure, and one far larger than them slower.
    """

    def __init__(self, backend: DeviceBackend, batches: list[list[int]]) -> None:
        self._backend = backend
        self._stream = backend.new_stream()
        self._batches = batches
        largest = max((sum(sizes) for sizes in batches), default=0)
        self._host = backend.empty_host(max(sum(map(sum, batches)), 1), torch.uint8)
        self._host.fill_(1)
        self._device = backend.empty((max(2 * largest, 1),), torch.uint8)
        self._device.fill_(1)

    def copy(self) -> None:
        host_offset = 0
        for index, sizes in enumerate(self._batches):
            device_offset = (index % 2) * (self._device.numel() // 2)
            pairs = []
            for size in sizes:
                pairs.append(
                    (self._host[host_offset : host_offset + size], self._device[device_offset : device_offset + size])
                )
                host_offset += size
                device_offset += size
            for host, device in pairs:
                self._backend.copy(device, host, stream=self._stream)
            for host, device in pairs:
                self._backend.copy(host, device, stream=self._stream)

    def release(self) -> None:
        self._backend.synchronize()
        self._backend.release_storage(self._device)


def _transfer_sizes(optimizer: SwapOptimizer) -> list[list[int]]:
    """Bytes of each copy of each batch of ``optimizer``'s current plan (what one direction of a step moves)."""
    return [list(batch.copy_bytes) for batch in planned_batches(optimizer)]


def _timed(step: Callable[[], object], backend: DeviceBackend) -> float:
    backend.synchronize()
    started = time.perf_counter()
    step()
    backend.synchronize()
    return time.perf_counter() - started


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Device bytes of every non-scalar state tensor of the unswapped optimizer."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )
