"""Modeled rows: one swapped step over meta tensors, timed on the simulator's virtual clock.

:func:`model_step` runs the real swap pipeline on :class:`~swap_core.sim.MetaBackend` (no data is
allocated) for a set of parameter shapes, and the unswapped optimizer beside it, and reports what
the rank would hold on the device and in host memory, what it copies and how long the step takes
on the modeled link. The planner (``swap-bench plan``) feeds it one rank's FSDP2 shard of a model;
the benchmark feeds it its workloads, next to their measured rows. Deterministic: the same numbers
on every machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import LinkModel, MetaBackend

from .measure import optimizer_state_bytes
from .workloads import OptimizerSpec

__all__ = ["ModeledRow", "StepModel", "model_step"]

TensorShapes = Sequence[tuple[tuple[int, ...], torch.dtype]]


@dataclasses.dataclass(frozen=True)
class StepModel:
    """What to model: parameters, optimizer, link and swap options."""

    name: str
    """The workload or model the parameters come from."""
    tensors: TensorShapes
    """``(shape, dtype)`` of every parameter this rank holds."""
    optimizer: OptimizerSpec
    link: str
    """A :data:`~swap_core.sim.LINK_PRESETS` name."""
    swap_times: int
    master_weights: bool = False
    packed: bool = True
    duplex: bool = True
    world: int = 1
    rank: int = 0
    optimizer_options: Mapping[str, object] = dataclasses.field(default_factory=dict)
    """Added to the optimizer's hyperparameters (unswapped and swapped alike), e.g. ``foreach=True``."""


@dataclasses.dataclass(frozen=True)
class ModeledRow:
    """One modeled step of one rank: bytes and copies exact, seconds on the virtual clock (labeled modeled)."""

    name: str
    optimizer: str
    world: int
    rank: int
    link: str
    swap_times: int
    packed: bool
    duplex: bool
    master_weights: bool
    params: int
    """Parameters (elements) this rank's optimizer owns."""
    plain_state_device_bytes: int
    """Device bytes of the unswapped optimizer's states (and, with master weights, its fp32 masters)."""
    device_peak_state_bytes: int
    """Peak device bytes of states and masters during the swapped step (staging and resident states)."""
    host_state_bytes: int
    host_pinned_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    copies: int
    """Host-to-device plus device-to-host copies per step."""
    batches: int
    update_seconds: float
    """T_c: the unswapped optimizer's update on the modeled device (its ops' bytes over device bandwidth)."""
    modeled_step_seconds: float
    """How far a cold step (device idle at entry, no prefetch) extends the compute stream."""
    modeled_transfer_seconds: float
    """From ``step()`` until its last offload finished."""
    bound_seconds: float
    """max(S/B_down, S/B_up) x (1 + 1/k) + T_c / k: the cold duplex pipeline's bound."""
    link_utilization: float
    """Busy time of the busier link direction over ``modeled_transfer_seconds``."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def model_step(model: StepModel) -> ModeledRow:
    """Model ``model``'s second (steady) swapped step and its unswapped optimizer on meta tensors."""
    link = LinkModel.preset(model.link)
    plain_state_bytes, update_seconds = _plain_optimizer(model, link)
    backend = MetaBackend(link)
    config = SwapConfig(
        backend=backend,
        swap_times=model.swap_times,
        packed=model.packed,
        duplex=model.duplex,
        master_weights=model.master_weights,
    )
    params = _meta_params(model.tensors, model.optimizer)
    swapped = swap_optimizer(model.optimizer.build(params, **model.optimizer_options), config)
    swapped.step()  # creates the states and offloads them
    backend.synchronize()  # the measured step starts with the device idle
    swapped.step()
    stats = swapped.stats
    assert stats.modeled_step_seconds is not None and stats.modeled_transfer_seconds is not None
    busiest = max(stats.h2d_bytes / (link.h2d_gbps * 1e9), stats.d2h_bytes / (link.d2h_gbps * 1e9))
    batches = max(stats.batches, 1)
    return ModeledRow(
        name=model.name,
        optimizer=model.optimizer.name,
        world=model.world,
        rank=model.rank,
        link=model.link,
        swap_times=model.swap_times,
        packed=model.packed,
        duplex=model.duplex,
        master_weights=model.master_weights,
        params=sum(param.numel() for param in params),
        plain_state_device_bytes=plain_state_bytes,
        device_peak_state_bytes=stats.peak_state_device_bytes,
        host_state_bytes=stats.host_state_bytes,
        host_pinned_bytes=stats.host_pinned_bytes,
        h2d_bytes=stats.h2d_bytes,
        d2h_bytes=stats.d2h_bytes,
        copies=stats.h2d_copies + stats.d2h_copies,
        batches=stats.batches,
        update_seconds=update_seconds,
        modeled_step_seconds=stats.modeled_step_seconds,
        modeled_transfer_seconds=stats.modeled_transfer_seconds,
        bound_seconds=busiest * (1 + 1 / batches) + update_seconds / batches,
        link_utilization=busiest / stats.modeled_transfer_seconds if stats.modeled_transfer_seconds > 0 else 0.0,
    )


def _meta_params(tensors: TensorShapes, optimizer: OptimizerSpec) -> list[torch.nn.Parameter]:
    """Meta parameters with meta gradients: the ones ``optimizer`` accepts, empty shards left out."""
    params = []
    for shape, dtype in tensors:
        param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
        if param.numel() == 0 or not optimizer.accepts(param):
            continue
        param.grad = torch.empty_like(param)
        params.append(param)
    return params


def _plain_optimizer(model: StepModel, link: LinkModel) -> tuple[int, float]:
    """Device state bytes of the unswapped optimizer and the modeled time of its update (its second step).

    With master weights, the unswapped reference is the optimizer over fp32 masters on the device: its
    states and the masters count.
    """
    backend = MetaBackend(link)
    params = _meta_params(model.tensors, model.optimizer)
    masters_bytes = 0
    if model.master_weights:
        low_precision = [param for param in params if param.dtype in (torch.bfloat16, torch.float16)]
        masters_bytes = sum(param.numel() * 4 for param in low_precision)
        params = [_fp32_leaf(param) if param.dtype in (torch.bfloat16, torch.float16) else param for param in params]
    optimizer = model.optimizer.build(params, **model.optimizer_options)
    optimizer.step()  # creates the states
    before = backend.modeled_times()
    with backend.compute_scope():
        optimizer.step()
    after = backend.modeled_times()
    assert before is not None and after is not None
    return optimizer_state_bytes(optimizer) + masters_bytes, after.compute - before.compute


def _fp32_leaf(param: torch.nn.Parameter) -> torch.nn.Parameter:
    master = torch.nn.Parameter(torch.empty(param.shape, dtype=torch.float32, device="meta"))
    master.grad = torch.empty_like(master)
    return master
