"""``swap-bench plan``: will a training job fit, and how much slower will it be? One screen, 100 columns.

Given a model, its FSDP2 world, the device and host memory, the dtype and the tokens a rank, the verdict adds up one
rank's device memory at the step's peak and the pinned host memory of a node:

- weights: the rank's FSDP2 shard, and two units (decoder layers) gathered whole, the one computing and the one
  prefetched (none at world 1);
- gradients: the shard's, and one unit's whole before its reduce-scatter (none at world 1);
- activations: an estimate (:func:`activation_bytes`), said as such;
- the swap's staging and resident states at the step's peak, from the real swap pipeline run over meta tensors, at
  ``SwapConfig``'s default batch count, or the fewest batches whose staging fits what the rest leaves
  (:func:`~swap_bench.planner.recommend`) where the default's does not;
- the pinned host bytes of a node: its ranks' states (and masters), twice with the step inside the backward.

It models the iteration unswapped and swapped both ways (:func:`~swap_bench.iteration.model_iteration`), recommends
a mode and prints the ``SwapConfig(...)`` to paste. Weights, gradients and staging are exact for the parameters and
states; the activations depend on the model's code, and the whole leaves out the allocator's fragmentation and
the framework's workspaces, so leave a margin.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from swap_core.errors import DeviceMemoryError

from .iteration import IterationModel, IterationRow, model_iteration
from .modeled import ModeledRow
from .models import ModelShape, fsdp_shard_shape
from .planner import DEFAULT_SWAP_TIMES, plan_model, recommend
from .workloads import OPTIMIZERS

__all__ = ["DEFAULT_SWAP_TIMES", "DeviceBytes", "Job", "Verdict", "activation_bytes", "device_bytes", "judge"]

StepPlace = Literal["after_backward", "in_backward"]


@dataclasses.dataclass(frozen=True)
class Job:
    """One training job, as a user would describe it."""

    model: ModelShape
    world: int
    ranks_per_node: int
    device_memory: int
    """Bytes of one device."""
    host_memory: int | None
    """Bytes of one node's host memory (``None``: not checked)."""
    master_weights: bool
    """bf16 parameters with fp32 masters (``True``) or fp32 parameters."""
    tokens: int
    """A rank's tokens per micro-batch (sequence length x micro-batch size)."""
    activation_checkpointing: bool
    link: str
    optimizer: str = "adamw"
    iterations: bool = True
    """Model the iterations (seconds on the virtual clock; a few seconds to minutes)."""

    @property
    def param_bytes(self) -> int:
        return 2 if self.master_weights else 4


@dataclasses.dataclass(frozen=True)
class DeviceBytes:
    """One rank's device bytes at the step's peak, before the optimizer's."""

    weights: int
    gradients: int
    activations: int
    """An estimate (:func:`activation_bytes`)."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.activations


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What :func:`judge` found."""

    job: Job
    device: DeviceBytes
    step: ModeledRow | None
    """The swapped step after the backward at the recommended batch count (``None``: nothing is left for the
    swap)."""
    iteration: IterationRow | None
    mode: StepPlace
    """Where the step runs: inside the backward where it is faster and its host bytes fit."""
    host_after: int
    """Pinned host bytes of a node stepping after the backward."""
    host_inside: int
    """The same stepping inside the backward (provisional updates keep a second copy of the states)."""
    step_inside: ModeledRow | None = None
    """The swapped step as it is inside the backward, where masters stay fp32 (``SwapConfig.master_remainders``);
    the same as :attr:`step` without master weights."""

    @property
    def chosen_step(self) -> ModeledRow | None:
        """The swapped step in :attr:`mode`."""
        return self.step_inside if self.mode == "in_backward" else self.step

    @property
    def host_bytes_per_node(self) -> int:
        """Pinned host bytes of a node in :attr:`mode`."""
        return self.host_inside if self.mode == "in_backward" else self.host_after

    @property
    def device_peak(self) -> int:
        step = self.chosen_step
        return self.device.total + (step.device_peak_state_bytes if step is not None else 0)

    @property
    def fits_device(self) -> bool:
        return self.chosen_step is not None and self.device_peak <= self.job.device_memory

    @property
    def fits_host(self) -> bool:
        return self.job.host_memory is None or self.host_bytes_per_node <= self.job.host_memory

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    @property
    def fits_unswapped(self) -> bool:
        """Whether the job would fit without swapping (its optimizer's states and masters on the device)."""
        plain = self.step.plain_state_device_bytes if self.step is not None else 0
        return self.step is not None and self.device.total + plain <= self.job.device_memory

    def config_line(self) -> str:
        """The ``SwapConfig(...)`` to paste."""
        step = self.chosen_step
        assert step is not None
        options = [] if step.batches == DEFAULT_SWAP_TIMES else [f"swap_times={step.batches}"]
        if self.job.master_weights:
            options.append("master_weights=True")
        if self.mode == "in_backward":
            options.append('step="in_backward"')
        return f"SwapConfig({', '.join(options)})"


def activation_bytes(model: ModelShape, tokens: int, *, checkpointing: bool) -> int:
    """An estimate of the activations one rank keeps for its backward, bf16, with a fused (flash) attention.

    Each decoder layer keeps, a token, what torch's autograd saves for it (counted in a test on a Llama-style layer
    built of torch's ``rms_norm``, ``scaled_dot_product_attention`` and a SwiGLU MLP): each of its two norms its
    input and its normalized output in fp32 (``8 h`` bf16 elements together) and the bf16 input of the projections
    after it (``2 h``); the fused attention its rotated queries and keys, values and output (``2 h + 2 kv``; the
    output projection reads that output in place); the MLP its gate, up, activated gate and product (``4 i``):
    ``12 h + 2 kv + 4 i`` elements (``h`` hidden, ``kv`` the keys' width, ``i`` the MLP's), small per-token
    scalars left out. With activation checkpointing a layer keeps its input (``h``) and one layer at a time
    recomputes all of it. The head keeps its norm's input and its projection's (``2 h``) and fp32 logits and
    log-probabilities for the loss (``8 V`` bytes, ``V`` the vocabulary).
    """
    kv = model.num_key_value_heads * (model.hidden_size // model.num_attention_heads)
    layer = 12 * model.hidden_size + 2 * kv + 4 * model.intermediate_size
    # Checkpointed, each layer keeps its input and one at a time recomputes everything.
    kept = model.hidden_size if checkpointing else layer
    layers = model.num_hidden_layers * kept + (layer if checkpointing else 0)
    return tokens * (2 * (layers + 2 * model.hidden_size) + 8 * model.vocab_size)


def device_bytes(job: Job) -> DeviceBytes:
    """One rank's weights, gradients and activations (rank 0, whose shard is the largest)."""
    units: dict[str, int] = {}
    shard = 0
    for name, shape in job.model.parameter_shapes():
        unit = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
        units[unit] = units.get(unit, 0) + _numel(shape)
        shard += _numel(fsdp_shard_shape(shape, job.world, 0))
    gathered = max(units.values()) if job.world > 1 else 0
    return DeviceBytes(
        weights=(shard + 2 * gathered) * job.param_bytes,
        gradients=(shard + gathered) * job.param_bytes,
        activations=activation_bytes(job.model, job.tokens, checkpointing=job.activation_checkpointing),
    )


def judge(job: Job) -> Verdict:
    """The verdict on ``job`` (see the module)."""
    device = device_bytes(job)
    left = job.device_memory - device.total
    step = _swapped_step(job, left) if left > 0 else None
    iteration = None
    if step is not None and job.iterations:
        spec = IterationModel(
            job.model,
            job.world,
            job.tokens,
            OPTIMIZERS[job.optimizer],
            job.link,
            swap_times=step.batches,
            master_weights=job.master_weights,
            ranks_per_node=job.ranks_per_node,
        )
        iteration = model_iteration(spec)
    # Inside the backward masters stay fp32: its own staging and host bytes.
    step_inside = _swapped_step(job, left, master_remainders=False) if step is not None and job.master_weights else step
    after, inside = _host_bytes_per_node(job, step, step_inside)
    faster_inside = iteration is None or iteration.in_backward_seconds < iteration.after_backward_seconds
    room_inside = step_inside is not None and (job.host_memory is None or inside <= job.host_memory)
    mode: StepPlace = "in_backward" if faster_inside and room_inside else "after_backward"
    return Verdict(job, device, step, iteration, mode, after, inside, step_inside)


def _swapped_step(job: Job, left: int, *, master_remainders: bool = True) -> ModeledRow | None:
    """The swapped step at ``SwapConfig``'s default batch count if its staging fits ``left`` bytes, else at the
    fewest batches whose staging does; ``None`` if none does. ``master_remainders``: as
    ``SwapConfig.master_remainders`` (``False``: fp32 masters, as inside the backward)."""
    options: dict[str, Any] = {
        "world": job.world,
        "link": job.link,
        "master_weights": job.master_weights,
        "ranks_per_node": job.ranks_per_node,
        "device_memory": left,
        "master_remainders": master_remainders,
    }
    try:
        return plan_model(job.model, job.optimizer, swap_times=DEFAULT_SWAP_TIMES, **options)
    except torch.OutOfMemoryError:
        pass  # more batches, each staging less
    try:
        chosen, _ = recommend(job.model, job.optimizer, **options)
    except (DeviceMemoryError, torch.OutOfMemoryError):
        return None  # no batch count's staging fits what the rest leaves
    return chosen


def _host_bytes_per_node(job: Job, step: ModeledRow | None, inside_step: ModeledRow | None) -> tuple[int, int]:
    """A node's pinned host bytes stepping after the backward (``step``) and inside it (``inside_step``, fp32
    masters; provisional updates: a second copy of the states, and a copy of the parameters that keep no fp32
    master)."""
    after = step.host_pinned_bytes if step is not None else 0
    inside = 0
    if inside_step is not None:
        param_copies = 0 if job.master_weights else inside_step.params * job.param_bytes
        inside = inside_step.host_pinned_bytes + inside_step.host_state_bytes + param_copies
    return after * job.ranks_per_node, inside * job.ranks_per_node


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
