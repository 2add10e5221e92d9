"""One FSDP2 rank's forward and backward on the virtual clock: each layer's compute, all-gathers and reduce-scatters.

The model's layers (the embedding, each decoder layer, the head) are FSDP2's units. The forward all-gathers each
unit's parameters one unit ahead of its compute (FSDP2's prefetch) and the compute waits for its unit's gather;
the backward gathers them again (resharded after the forward), computes the unit's gradients, and reduce-scatters
them. A ring moves ``(world - 1) / world`` of a unit's full bytes in and as many out per collective, in the
model's dtype. The collectives take time only when the link says the rank's network card shares it
(``LinkModel.network_gbps``); otherwise they are taken as hidden under the compute, as FSDP2 overlaps them.

A layer's gradients are its reduce-scatter's result. Stepping inside the backward, the compute stream waits for it
before the layer's update (which it queues before the next layer's backward); stepping after the backward, it
waits once, for the last, before ``step()``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import torch

from swap_core.sim import MetaBackend

from .models import ModelShape, fsdp_shard_shape

__all__ = ["ModeledLayer", "model_layers", "modeled_forward_backward"]


@dataclasses.dataclass(frozen=True)
class ModeledLayer:
    """One FSDP2 unit of a rank: its parameter shards, its compute, and the bytes of one collective over it."""

    params: list[torch.nn.Parameter]
    """The rank's shards (meta tensors), those with elements."""
    forward_seconds: float
    backward_seconds: float
    ring_bytes: int
    """Bytes this rank receives, and as many it sends, in one all-gather or reduce-scatter of the unit."""


def model_layers(
    model: ModelShape, world: int, dtype: torch.dtype, compute_seconds: float, *, gathered_dtype: torch.dtype
) -> list[ModeledLayer]:
    """Rank 0's units of ``model`` in forward order, their shards in ``dtype``, gathered and reduced in
    ``gathered_dtype`` (the model's, where the optimizer updates fp32 masters in place of the parameters), the
    forward and backward's ``compute_seconds`` shared in proportion to their parameters (a third forward, two thirds
    backward)."""
    groups: dict[str, list[tuple[int, ...]]] = {}
    for name, shape in model.parameter_shapes():
        layer = re.match(r"model\.layers\.\d+\.", name)
        groups.setdefault(layer.group(0) if layer else _outside_layers(name), []).append(shape)
    element_bytes = torch.empty((), dtype=gathered_dtype).element_size()
    layers = []
    for shapes in groups.values():
        params = [
            torch.nn.Parameter(torch.empty(fsdp_shard_shape(shape, world, 0), dtype=dtype, device="meta"))
            for shape in shapes
        ]
        numel = sum(_numel(shape) for shape in shapes)
        share = numel / model.numel
        layers.append(
            ModeledLayer(
                params=[param for param in params if param.numel() > 0],
                forward_seconds=compute_seconds / 3 * share,
                backward_seconds=compute_seconds * 2 / 3 * share,
                ring_bytes=numel * element_bytes * (world - 1) // world,
            )
        )
    return layers


def modeled_forward_backward(
    backend: MetaBackend, layers: Sequence[ModeledLayer], *, gradients_used_in_backward: bool
) -> None:
    """A forward through ``layers``, then an autograd backward whose nodes model each layer's compute and hand its
    parameters their gradients (the last layer's first), with FSDP2's collectives (see the module)."""
    gathered = backend.model_collective(layers[0].ring_bytes, layers[0].ring_bytes)
    for index, layer in enumerate(layers):
        following = layers[index + 1] if index + 1 < len(layers) else layers[-1]  # the backward gathers it again
        gathering = backend.model_collective(following.ring_bytes, following.ring_bytes)
        backend.model_wait(gathered)
        backend.model_compute(layer.forward_seconds)
        gathered = gathering
    walk = _BackwardWalk(backend, layers, gathered, gradients_used_in_backward)
    hidden = torch.zeros((), device="meta")
    for index, layer in enumerate(layers):
        hidden = _LayerNode.apply(hidden, walk, index, *layer.params)  # type: ignore[no-untyped-call]
    torch.autograd.backward([hidden])
    backend.model_wait(walk.reduced)


class _BackwardWalk:
    """What the backward's nodes share: when the next unit's gather and the last reduce-scatter end."""

    def __init__(
        self, backend: MetaBackend, layers: Sequence[ModeledLayer], gathered: float, gradients_used: bool
    ) -> None:
        self.backend = backend
        self.layers = layers
        self.gathered = gathered
        self.reduced = 0.0
        self.gradients_used = gradients_used

    def layer_backward(self, index: int) -> None:
        backend, layer = self.backend, self.layers[index]
        gathered = self.gathered
        if index > 0:  # the unit before is gathered while this one computes
            before = self.layers[index - 1]
            self.gathered = backend.model_collective(before.ring_bytes, before.ring_bytes)
        backend.model_wait(gathered)
        backend.model_compute(layer.backward_seconds)
        self.reduced = backend.model_collective(layer.ring_bytes, layer.ring_bytes)
        if self.gradients_used:
            backend.model_wait(self.reduced)


class _LayerNode(torch.autograd.Function):
    """Forward: nothing (the forward is modeled apart); backward: the unit's modeled work, then gradients of its
    parameters' shapes."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, walk: _BackwardWalk, index: int, *params: torch.Tensor) -> Any:
        ctx.walk, ctx.index = walk, index
        ctx.shapes = [(param.shape, param.dtype) for param in params]
        return hidden.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.walk.layer_backward(ctx.index)
        grads = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in ctx.shapes]
        return grad, None, None, *grads


def _outside_layers(name: str) -> str:
    """The embedding's group, or the head's (the final norm and the output projection)."""
    return "embedding" if "embed" in name else "head"


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
