"""Modeled rows: one swapped step over meta tensors, timed on the simulator's virtual clock.

:func:`model_step` runs the real swap pipeline on :class:`~swap_core.sim.MetaBackend` (no data is
allocated) for a set of parameter shapes, and the unswapped optimizer beside it, and reports what
the rank would hold on the device and in host memory, what it copies and how long the step takes
on the modeled link. The planner (``swap-bench plan --tables``) feeds it one rank's FSDP2 shard of a model;
the benchmark feeds it its workloads, next to their measured rows. Deterministic: the same numbers
on every machine.

With ``StepModel.fsdp2`` the parameters are FSDP2's DTensors, stepped as one rank of a fake process group
(:mod:`~swap_bench.fake_world`): distributed Muon (swap-muon) plans its owner ranks and issues its
``all_to_all`` collectives as on a real world, which complete at once and move nothing. The link model
has no interconnect, so the modeled seconds leave the collectives' network time out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch.distributed.device_mesh import DeviceMesh

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.sim import LinkModel, MetaBackend

from .fake_world import fake_world
from .measure import optimizer_state_bytes
from .models import fsdp_shard_shape
from .workloads import OptimizerSpec

FEWER_BATCHES_WARNING = r"SwapConfig\(swap_times=\d+\) asked for \d+ batches, but only"
"""The start of swap-core's warning that a step runs fewer batches than asked (see ``batch_count.py``)."""

__all__ = ["ModeledRow", "StepModel", "model_step"]

TensorShapes = Sequence[tuple[tuple[int, ...], torch.dtype]]


@dataclasses.dataclass(frozen=True)
class StepModel:
    """What to model: parameters, optimizer, link and swap options."""

    name: str
    """The workload or model the parameters come from."""
    tensors: TensorShapes
    """``(shape, dtype)`` of every parameter this rank holds (whole parameters with ``fsdp2``)."""
    optimizer: OptimizerSpec
    link: str
    """A :data:`~swap_core.sim.LINK_PRESETS` name."""
    swap_times: int | Literal["auto"]
    master_weights: bool = False
    master_remainders: bool = True
    """``SwapConfig.master_remainders``: with ``master_weights``, a bf16 master swapped as the bits its parameter
    lacks (2.125 bytes a parameter), else fp32 (4)."""
    ranks_per_node: int = 1
    """Ranks streaming through one host's memory as this one does (``LinkModel.ranks_sharing_host``): the rank's
    copies get the preset's host memory bandwidth divided by this."""
    packed: bool = True
    duplex: bool = True
    staging_buffers: int = 2
    """Batches staged on the device at a time (``SwapConfig.staging_buffers``)."""
    world: int = 1
    rank: int = 0
    optimizer_options: Mapping[str, object] = dataclasses.field(default_factory=dict)
    """Added to the optimizer's hyperparameters (unswapped and swapped alike), e.g. ``foreach=True``."""
    fsdp2: bool = False
    """Step ``tensors`` as FSDP2 parameters (DTensors, ``Shard(0)``) on rank ``rank`` of a fake process group of
    ``world`` ranks, as distributed Muon needs; otherwise ``tensors`` are plain tensors, the rank's shards."""
    device_memory: int | None = None
    """Device bytes the swap may use (staging and resident states: what the model, its gradients and activations
    leave); ``None``: unlimited. ``swap_times="auto"`` chooses the batches from it."""


@dataclasses.dataclass(frozen=True)
class ModeledRow:
    """One modeled step of one rank: bytes and copies exact, seconds on the virtual clock (labeled modeled)."""

    name: str
    optimizer: str
    world: int
    rank: int
    link: str
    """The :data:`~swap_core.sim.LINK_PRESETS` name: theoretical rates, or measured ones (``-achievable``)."""
    ranks_per_node: int
    link_model: dict[str, float | int | None]
    """The figures the row was modeled with: every field of the preset's ``LinkModel``, ``ranks_sharing_host`` =
    ``ranks_per_node``."""
    swap_times: int | str
    """The ``swap_times`` asked (a number, or ``"auto"``: then ``batches`` is the choice)."""
    packed: bool
    duplex: bool
    master_weights: bool
    params: int
    """Parameters (elements) this rank holds: its shards of the optimizer's parameters."""
    plain_state_device_bytes: int
    """Device bytes of the unswapped optimizer's states (and, with master weights, its fp32 masters). With
    ``fsdp2``: the same swapped optimizer with every state resident (``SwapConfig(offload_fraction=0.0)``), so
    that distributed Muon keeps its owner layout (each owner holds the whole momentum of its matrices)."""
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
    """The cold duplex pipeline's bound for k balanced batches (a = S/(k B_down), c = T_c/k, o = S/(k B_up), each
    copy alone at its bandwidth, the host share included): the larger of one batch's copy-in, update and copy-out in
    turn plus k - 1 times the slowest of them, and a + o + (k - 1) d, the shared link's, where d =
    ``LinkModel.concurrent_copy_seconds`` of a batch's copy-in beside a copy-out (more than max(a, o) where the
    duplex factor or the host memory share binds). On a full-duplex link with host memory to spare the first: that
    is max(S/B_down, S/B_up) x (1 + 1/k) + T_c / k where the link is the bottleneck (both directions equally fast),
    and T_c + (S/B_down + S/B_up) / k where the update is (e.g. Muon's Newton-Schulz)."""
    link_utilization: float
    """Busy time of the busier link direction, at its bandwidth alone, over ``modeled_transfer_seconds``."""
    device_memory: int | None = None
    """The device bytes the swap could use (``StepModel.device_memory``), or ``None``: unlimited."""
    staging_buffers: int = 2
    """Batches staged on the device at a time (``SwapConfig.staging_buffers``)."""

    @property
    def batches_label(self) -> str:
        """``swap_times`` as a table shows it: the number, or the number ``"auto"`` chose; and the staging buffers
        where they are not the default two."""
        notes = ["auto"] if self.swap_times == "auto" else []
        if self.staging_buffers != 2:
            notes.append(f"{self.staging_buffers} staged")
        count = self.batches if self.swap_times == "auto" else self.swap_times
        return f"{count} ({', '.join(notes)})" if notes else str(count)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def model_step(model: StepModel) -> ModeledRow:
    """Model ``model``'s second (steady) swapped step and its unswapped optimizer on meta tensors."""
    link = dataclasses.replace(LinkModel.preset(model.link), ranks_sharing_host=model.ranks_per_node)
    world: contextlib.AbstractContextManager[DeviceMesh | None] = (
        fake_world(model.world, model.rank) if model.fsdp2 else contextlib.nullcontext()
    )
    with world as mesh:  # plain tensors need no process group
        if mesh is None:
            plain_state_bytes, update_seconds = _plain_optimizer(model, link)
        else:
            plain_state_bytes, update_seconds = _resident_optimizer(model, link, mesh)
        backend = MetaBackend(link, device_memory=model.device_memory)
        params = _meta_params(model.tensors, model.optimizer, mesh)
        swapped = _steady_swapped_step(model, backend, params, offload_fraction=1.0)
        held = sum(_local(param).numel() for param in params)
    stats = swapped.stats
    assert stats.modeled_step_seconds is not None and stats.modeled_transfer_seconds is not None
    copy_in, copy_out = link.copy_seconds("h2d", stats.h2d_bytes), link.copy_seconds("d2h", stats.d2h_bytes)
    busiest = max(copy_in, copy_out)
    both_ways = link.concurrent_copy_seconds(stats.h2d_bytes, stats.d2h_bytes)
    batches = max(stats.batches, 1)
    return ModeledRow(
        name=model.name,
        optimizer=model.optimizer.name,
        world=model.world,
        rank=model.rank,
        link=model.link,
        ranks_per_node=model.ranks_per_node,
        link_model=dataclasses.asdict(link),
        swap_times=model.swap_times,
        packed=model.packed,
        duplex=model.duplex,
        master_weights=model.master_weights,
        params=held,
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
        bound_seconds=_pipeline_bound(copy_in, update_seconds, copy_out, both_ways, batches),
        link_utilization=busiest / stats.modeled_transfer_seconds if stats.modeled_transfer_seconds > 0 else 0.0,
        device_memory=model.device_memory,
        staging_buffers=model.staging_buffers,
    )


def _pipeline_bound(copy_in: float, update: float, copy_out: float, both_ways: float, batches: int) -> float:
    """The least makespan of ``batches`` balanced three-stage batches whose stages together take these seconds.

    The larger of two bounds: one batch's three stages plus ``batches - 1`` times the slowest (a flow shop), and
    the shared link's (the first copy-in and the last copy-out alone, every other copy beside one in the other
    direction, ``both_ways`` for all copies moved that way). On a full-duplex link with host memory to spare the
    second never exceeds the first.
    """
    stages = (copy_in / batches, update / batches, copy_out / batches)
    flow_shop = sum(stages) + (batches - 1) * max(stages)
    shared_link = stages[0] + stages[2] + (batches - 1) * both_ways / batches
    return max(flow_shop, shared_link)


def _steady_swapped_step(
    model: StepModel, backend: MetaBackend, params: list[torch.nn.Parameter], *, offload_fraction: float
) -> SwapOptimizer:
    """The swapped optimizer over ``params`` after its second step, which began with the device idle."""
    config = SwapConfig(
        backend=backend,
        swap_times=model.swap_times,
        packed=model.packed,
        duplex=model.duplex,
        staging_buffers=model.staging_buffers,
        master_weights=model.master_weights,
        master_remainders=model.master_remainders,
        offload_fraction=offload_fraction,
    )
    swapped = swap_optimizer(model.optimizer.build(params, **model.optimizer_options), config)
    with warnings.catch_warnings():
        # A count above the swapped parameters runs fewer batches: the row's `batches` says how many.
        warnings.filterwarnings("ignore", FEWER_BATCHES_WARNING, UserWarning)
        swapped.step()  # creates the states and offloads them
        backend.synchronize()  # the measured step starts with the device idle
        swapped.step()
    return swapped


def _meta_params(
    tensors: TensorShapes, optimizer: OptimizerSpec, mesh: DeviceMesh | None = None
) -> list[torch.nn.Parameter]:
    """Meta parameters with meta gradients, the ones ``optimizer`` accepts: plain tensors without ``mesh`` (empty
    shards left out), else FSDP2's DTensors over ``mesh`` (every rank holds every parameter, rows or not)."""
    params = []
    for shape, dtype in tensors:
        whole = torch.empty(shape, dtype=dtype, device="meta")
        if not optimizer.accepts(whole):
            continue
        if mesh is None:
            if whole.numel() == 0:
                continue
            param = torch.nn.Parameter(whole)
            param.grad = torch.empty_like(param)
        else:
            param = torch.nn.Parameter(_fsdp2_shard(whole, mesh))
            param.grad = _fsdp2_shard(whole, mesh)
        params.append(param)
    return params


def _fsdp2_shard(whole: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's ``Shard(0)`` block of ``whole`` as FSDP2 holds it: a DTensor with the global shape."""
    from torch.distributed.tensor import DTensor, Shard

    local_shape = fsdp_shard_shape(tuple(whole.shape), mesh.size(), mesh.get_local_rank())
    local = torch.empty(local_shape, dtype=whole.dtype, device="meta")
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=whole.shape, stride=whole.stride())


def _local(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``param``: a DTensor's local block, or the tensor itself."""
    to_local = getattr(param, "to_local", None)
    return param if to_local is None else to_local()


def _resident_optimizer(model: StepModel, link: LinkModel, mesh: DeviceMesh) -> tuple[int, float]:
    """Device state bytes and modeled update time of the swapped optimizer with every state resident.

    The reference of ``fsdp2`` rows: distributed Muon's owner layout (whole momentum on one rank per matrix)
    has no unswapped torch counterpart, so the same optimizer without swapping stands in for it.
    """
    backend = MetaBackend(link)
    resident = _steady_swapped_step(
        model, backend, _meta_params(model.tensors, model.optimizer, mesh), offload_fraction=0.0
    )
    seconds = resident.stats.modeled_step_seconds
    assert seconds is not None, "a MetaBackend with a link model times every step"
    return resident.stats.resident_state_device_bytes, seconds


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
