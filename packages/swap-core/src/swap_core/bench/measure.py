"""One benchmark row: the swapped and the unswapped optimizer, stepped alternately in the same run."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ..backends.protocol import DeviceBackend
from ..config import SwapConfig
from ..wrap import swap_optimizer
from .link import LinkBandwidth
from .workloads import OptimizerSpec, Workload

__all__ = ["RowConfig", "RowResult", "measure_row"]


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
    copy_floor_s: float
    copy_floor_efficiency: float | None
    """Copy floor over the time swapping added; ``None`` when it added none (copies hidden, or noise)."""
    ideal_step_s: float
    ideal_percent: float
    peak_state_device_bytes_swapped: int
    peak_state_device_bytes_unswapped: int

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
    for _ in range(warmup):
        plain.step()
        swapped.step()
    plain_times, swapped_times = [], []
    for _ in range(repeats):  # alternate, so drifting machine load hits both alike
        plain_times.append(_timed(plain.step, backend))
        swapped_times.append(_timed(swapped.step, backend))
    stats = swapped.stats
    plain_s, swapped_s = statistics.median(plain_times), statistics.median(swapped_times)
    swapped_bytes = stats.h2d_bytes
    floor_s = stats.h2d_bytes / link.h2d + stats.d2h_bytes / link.d2h
    added_s = swapped_s - plain_s
    ideal_s = max(stats.h2d_bytes / link.h2d, stats.d2h_bytes / link.d2h) * (1 + 1 / stats.batches) + (
        plain_s / stats.batches
    )
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
        swapped_state_bytes=swapped_bytes,
        h2d_bytes=stats.h2d_bytes,
        d2h_bytes=stats.d2h_bytes,
        h2d_copies=stats.h2d_copies,
        d2h_copies=stats.d2h_copies,
        batches=stats.batches,
        achieved_gbps=(stats.h2d_bytes + stats.d2h_bytes) / swapped_s / 1e9,
        copy_floor_s=floor_s,
        copy_floor_efficiency=floor_s / added_s if added_s > 0 else None,
        ideal_step_s=ideal_s,
        ideal_percent=100.0 * ideal_s / swapped_s,
        peak_state_device_bytes_swapped=stats.peak_state_device_bytes,
        peak_state_device_bytes_unswapped=_state_bytes(plain),
    )


def _timed(step: Callable[[], object], backend: DeviceBackend) -> float:
    backend.synchronize()
    started = time.perf_counter()
    step()
    backend.synchronize()
    return time.perf_counter() - started


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Device bytes of every non-scalar state tensor of the unswapped optimizer."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )
