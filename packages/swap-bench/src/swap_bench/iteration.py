"""Modeled training iterations: a model shard's forward, backward and step on the virtual clock, per step mode.

:func:`model_iteration` runs, on :class:`~swap_core.sim.MetaBackend` (meta tensors, nothing allocated), a loop of
one rank of a model trained with FSDP2: a forward, a backward whose layers finalize their parameters' gradients
from the last layer to the first (a real autograd backward over the rank's shards, each layer's backward modeling
its compute), the loss read, and ``step()``. It times the iteration three ways, forward start to forward start:
with the optimizer unswapped, swapped with ``step="after_backward"`` and swapped with ``step="in_backward"``.

The compute is the model's training FLOPs at a stated utilization of the device's matmul peak: ``6 N T`` for ``N``
parameters and ``T`` tokens a rank, a third of it forward, the rest backward, each layer's share in proportion to
its parameters. FSDP2's all-gathers and reduce-scatters (:mod:`swap_bench.fsdp_layers`) cross the device's link
beside the swap's copies when the link preset says the rank's network card shares it (``LinkModel.network_gbps``,
``pcie5-achievable-nic``); with any other preset they are taken as hidden under the compute, as FSDP2 overlaps them.
Deterministic: the same numbers on every machine.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any, Literal

import torch

from swap_core import SwapConfig, SwapStats, swap_optimizer
from swap_core.sim import LinkModel, MetaBackend, modeled_iterations

from .fsdp_layers import ModeledLayer, model_layers, modeled_forward_backward
from .models import MODELS, ModelShape
from .workloads import OPTIMIZERS, OptimizerSpec

__all__ = [
    "MAX_NORM",
    "Clipping",
    "IterationModel",
    "IterationRow",
    "documented_models",
    "iteration_table",
    "model_iteration",
]

StepPlace = Literal["after_backward", "in_backward"]

Clipping = Literal["none", "not_binding", "binding"]
"""``clip_grad_norm_`` between the backward and ``step()`` in every loop: none; one that never binds (it multiplies
every gradient by exactly 1, in place: a step begun inside the backward commits); one that binds at every step (the
gradients, scaled, are new tensors: that step is taken back and redone after the backward)."""

MAX_NORM = 1.0
"""The norm the modeled loops clip to."""

ITERATIONS = 3
"""Iterations timed after the first (which creates the states): the last one is reported."""


@dataclasses.dataclass(frozen=True)
class IterationModel:
    """One rank of ``model`` trained under FSDP2 on ``world`` ranks, ``tokens`` tokens a rank per iteration."""

    model: ModelShape
    world: int
    tokens: int
    optimizer: OptimizerSpec
    link: str
    """A :data:`~swap_core.sim.LINK_PRESETS` name."""
    swap_times: int
    master_weights: bool = False
    master_remainders: bool = True
    """With ``master_weights``: ``SwapConfig.master_remainders`` (after the backward a bf16 master moves as the bits
    its parameter lacks; ``False``: fp32 masters there too)."""
    ranks_per_node: int = 1
    """Ranks sharing one host's memory bandwidth (``LinkModel.ranks_sharing_host``), at most ``world``; 1: the
    preset as it stands, one rank alone on its host."""
    utilization: float = 0.4
    """The forward's and backward's share of the device's matmul peak (``LinkModel.device_tflops``)."""
    staging_buffers: int = 2
    """Batches staged on the device at a time (``SwapConfig.staging_buffers``)."""
    clipping: Clipping = "none"
    """Whether and how every loop clips its gradients' total norm before ``step()``."""

    @property
    def compute_seconds(self) -> float:
        """The forward and backward: ``6 N T`` FLOPs at ``utilization`` of the peak."""
        link = LinkModel.preset(self.link)
        return 6 * self.model.numel * self.tokens / (self.utilization * link.device_tflops * 1e12)


@dataclasses.dataclass(frozen=True)
class IterationRow:
    """A modeled iteration of one rank, forward start to forward start, unswapped and swapped both ways."""

    name: str
    world: int
    tokens: int
    optimizer: str
    link: str
    master_weights: bool
    ranks_per_node: int
    swap_times: int
    staging_buffers: int
    clipping: Clipping
    utilization: float
    """The forward's and backward's share of the device's matmul peak."""
    compute_seconds: float
    """The forward and backward alone."""
    unswapped_seconds: float
    """With every state (and master) on the device."""
    after_backward_seconds: float
    in_backward_seconds: float
    transfer_bound_seconds: float
    """Every swapped byte copied in and out once an iteration, both directions at once at the link's rate, beside
    the collectives' bytes where they share the link (``LinkModel.concurrent_copy_seconds``): no iteration of a
    swapped optimizer is shorter than this or than the unswapped one."""
    swapped_bytes: int
    """Bytes of state (and masters) copied each way an iteration."""
    collective_bytes: int
    """Bytes FSDP2's collectives move each way an iteration (two all-gathers and a reduce-scatter of every unit);
    they share the link only with a preset whose ``network_gbps`` is set."""
    host_bytes_after_backward: int
    """Host bytes the swapped optimizer holds stepping after the backward: its states' (and masters') host copies."""
    host_bytes_in_backward: int
    """The same stepping inside the backward with provisional updates (the default there): twice the states' host
    bytes (the spare copy the walk writes until ``step()`` commits) and the pinned copies of the parameters without
    an fp32 master."""

    @property
    def lower_bound_seconds(self) -> float:
        """The larger of the unswapped iteration and the transfers' bound."""
        return max(self.unswapped_seconds, self.transfer_bound_seconds)

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "lower_bound_seconds": self.lower_bound_seconds}


def model_iteration(spec: IterationModel) -> IterationRow:
    """Time ``spec``'s iteration unswapped, swapped after the backward and swapped inside it (each the last of
    :data:`ITERATIONS` steady iterations, after the one that creates the states)."""
    if not 1 <= spec.ranks_per_node <= spec.world:
        raise ValueError(f"ranks_per_node must be in 1..world={spec.world}, got {spec.ranks_per_node}")
    link = dataclasses.replace(LinkModel.preset(spec.link), ranks_sharing_host=spec.ranks_per_node)
    unswapped, _ = _timed_loop(spec, link, None)
    after_backward, after_stats = _timed_loop(spec, link, "after_backward")
    in_backward, stats = _timed_loop(spec, link, "in_backward")
    assert after_stats is not None and stats is not None
    collective_bytes = 3 * sum(layer.ring_bytes for layer in _layers(spec, torch.float32))
    return IterationRow(
        name=spec.model.name,
        world=spec.world,
        tokens=spec.tokens,
        optimizer=spec.optimizer.name,
        link=spec.link,
        master_weights=spec.master_weights,
        ranks_per_node=spec.ranks_per_node,
        swap_times=spec.swap_times,
        staging_buffers=spec.staging_buffers,
        clipping=spec.clipping,
        utilization=spec.utilization,
        compute_seconds=spec.compute_seconds,
        unswapped_seconds=unswapped,
        after_backward_seconds=after_backward,
        in_backward_seconds=in_backward,
        transfer_bound_seconds=link.concurrent_copy_seconds(
            stats.h2d_bytes, stats.h2d_bytes, collective_nbytes=collective_bytes
        ),
        swapped_bytes=stats.h2d_bytes,
        collective_bytes=collective_bytes,
        host_bytes_after_backward=after_stats.host_state_bytes,
        host_bytes_in_backward=stats.host_state_bytes + stats.host_spare_bytes + stats.host_param_copy_bytes,
    )


def _timed_loop(spec: IterationModel, link: LinkModel, step: StepPlace | None) -> tuple[float, SwapStats | None]:
    """The last iteration's seconds and its step's stats (``None`` unswapped: ``step=None``)."""
    backend = MetaBackend(link)
    # Unswapped with master weights: the optimizer over the fp32 masters (the casts to and from them left out).
    dtype = torch.bfloat16 if spec.master_weights and step is not None else torch.float32
    layers = _layers(spec, dtype)
    params = [param for layer in layers for param in layer.params]
    optimizer = spec.optimizer.build(params)
    if step is None:

        def run_step() -> None:
            _clip(backend, params, spec.clipping)
            with backend.compute_scope():
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    else:
        config = SwapConfig(
            backend=backend,
            swap_times=spec.swap_times,
            staging_buffers=spec.staging_buffers,
            master_weights=spec.master_weights,
            master_remainders=spec.master_remainders,
            step=step,
        )
        optimizer = swap_optimizer(optimizer, config)

        def run_step() -> None:
            _clip(backend, params, spec.clipping)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step == "in_backward":
                optimizer.prefetch()  # the next walk's first copy-in runs under the forward

    seconds = modeled_iterations(
        backend,
        run_step,
        forward_backward_seconds=0.0,  # each layer's forward and backward is modeled on its own
        iterations=ITERATIONS + 1,
        backward=lambda: modeled_forward_backward(backend, layers, gradients_used_in_backward=step == "in_backward"),
    )
    stats: SwapStats | None = getattr(optimizer, "stats", None)
    return seconds[-1], stats


def _clip(backend: MetaBackend, params: Sequence[torch.nn.Parameter], clipping: Clipping) -> None:
    """``clip_grad_norm_`` on the compute stream (its norms and its multiply timed by the bytes they touch); binding,
    the scaled gradients are new tensors, as a clip that changes them must be told from one that does not (meta
    tensors have no bits to compare)."""
    if clipping == "none":
        return
    with backend.compute_scope():
        if clipping == "not_binding":
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            return
        grads = [param.grad for param in params if param.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        coefficient = (MAX_NORM / (norm + 1e-6)).clamp(max=1.0)
        for param in params:
            if param.grad is not None:
                param.grad = param.grad * coefficient


def _layers(spec: IterationModel, dtype: torch.dtype) -> list[ModeledLayer]:
    """Rank 0's FSDP2 units of the model, in forward order, their parameters in ``dtype``, gathered in the model's
    (bf16 with master weights, fp32 without)."""
    gathered = torch.bfloat16 if spec.master_weights else torch.float32
    return model_layers(spec.model, spec.world, dtype, spec.compute_seconds, gathered_dtype=gathered)


def iteration_table(rows: Sequence[IterationRow]) -> str:
    """``rows`` as a markdown table: the iteration each way, and the swapped ones over the lower bound."""
    lines = [
        "| model | world | tokens a rank | masters | link, peak used | ranks a host | batches | staged | clipping | "
        "unswapped | after the backward | inside the backward | transfers' bound | inside / lower bound | "
        "host GB after / inside |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.name} | {row.world} | {row.tokens:,} | {'yes' if row.master_weights else 'no'} | "
            f"{row.link}, {row.utilization:.0%} | {row.ranks_per_node} | {row.swap_times} | {row.staging_buffers} | "
            f"{row.clipping.replace('_', ' ')} | "
            f"{row.unswapped_seconds * 1e3:.1f} ms | "
            f"{row.after_backward_seconds * 1e3:.1f} ms ({row.after_backward_seconds / row.unswapped_seconds:.3f} x) | "
            f"{row.in_backward_seconds * 1e3:.1f} ms ({row.in_backward_seconds / row.unswapped_seconds:.3f} x) | "
            f"{row.transfer_bound_seconds * 1e3:.1f} ms | {row.in_backward_seconds / row.lower_bound_seconds:.3f} x | "
            f"{row.host_bytes_after_backward / 1e9:.1f} / {row.host_bytes_in_backward / 1e9:.1f} |"
        )
    return "\n".join(lines)


def documented_models() -> list[IterationModel]:
    """The rows of docs/step-in-backward.md: a llama-7b rank with AdamW on PCIe 5 at its achievable rates, 8
    batches (16 at world 1), 40% of the peak: at world 8 with 4k and 64k tokens, with and without master weights,
    one and eight ranks a host; at world 1 with master weights, where the link cannot keep up, with two staging
    buffers and with three; at world 8 with 4k tokens, with and without master weights, clipping at 1.0 that never
    binds and that always binds; at world 8 with 4k tokens and master weights, at 55% of the peak with two staging
    buffers and with three, and with the collectives on the link (``pcie5-achievable-nic``)."""
    llama, adamw, link = MODELS["llama-7b"], OPTIMIZERS["adamw"], "pcie5-achievable"
    return [
        IterationModel(llama, 8, 4096, adamw, link, swap_times=8),
        IterationModel(llama, 8, 4096, adamw, link, swap_times=8, master_weights=True),
        IterationModel(llama, 8, 65536, adamw, link, swap_times=8),
        IterationModel(llama, 8, 4096, adamw, link, swap_times=8, master_weights=True, ranks_per_node=8),
        IterationModel(llama, 1, 4096, adamw, link, swap_times=16, master_weights=True),
        IterationModel(llama, 1, 4096, adamw, link, swap_times=16, master_weights=True, staging_buffers=3),
        *(
            IterationModel(llama, 8, 4096, adamw, link, swap_times=8, master_weights=masters, clipping=clipping)
            for masters in (False, True)
            for clipping in typing.get_args(Clipping)[1:]
        ),
        IterationModel(llama, 8, 4096, adamw, link, swap_times=8, master_weights=True, utilization=0.55),
        IterationModel(
            llama, 8, 4096, adamw, link, swap_times=8, master_weights=True, utilization=0.55, staging_buffers=3
        ),
        IterationModel(llama, 8, 4096, adamw, f"{link}-nic", swap_times=8, master_weights=True),
    ]
