"""Which tensors of a state dict are the optimizers' live state, and private host tensors in their place.

``SwapOptimizer.state_dict()`` hands out its host mirrors themselves. A save
reads them in place: a synchronous ``dcp.save`` finishes before the next step,
and ``dcp.async_save`` stages (copies) them before it returns. A load writes
into the tensors it is given: :func:`private_destinations` puts fresh host
tensors where live ones are, so a checked load reads the checkpoint completely
before ``load_state_dict`` writes anything live. :func:`host_snapshot` copies
the live tensors instead (for a save whose stager does not copy).

Tensors that are already private are left alone: distributed Muon's per-shard
momentum is exported into fresh tensors, and so is a full or CPU-offloaded
state dict. :func:`private_host_bytes` is what the tensors that are not live
hold: the host memory a checkpoint adds to the optimizer's own. Whether a
tensor is live is decided by where its bytes are (:class:`LiveMemory`), so an
alias of a host mirror (:mod:`swap_ckpt.stager_compat`) is live too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from swap_core.backends import StorageSpans

from .torch_compat import tree_leaves, tree_map_only

__all__ = ["LiveMemory", "host_copy", "host_empty_like", "host_snapshot", "private_destinations", "private_host_bytes"]


class LiveMemory:
    """The bytes of the optimizers' live tensors (every state entry and tensor hyper-parameter).

    Each live tensor contributes its whole storage, so every view of a packed swap buffer, and every
    alias of one, is live. ``tensor in live`` asks whether a tensor's first byte (a DTensor's local
    shard's) lies there; an empty tensor counts as live, which costs nothing wherever it matters.
    """

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        values: list[Any] = []
        for optimizer in optimizers:
            values += list(optimizer.state.values())
            values += [
                {key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups
            ]
        self._spans = StorageSpans(_local(leaf) for leaf in tree_leaves(values) if isinstance(leaf, torch.Tensor))

    def __contains__(self, tensor: object) -> bool:
        if not isinstance(tensor, torch.Tensor):
            return False
        local = _local(tensor)
        return local.numel() == 0 or local in self._spans


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor``; a DTensor stays a DTensor of the same layout over a copied local shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return _like_dtensor(tensor, tensor.to_local().to("cpu", copy=True))
    return tensor.detach().to("cpu", copy=True)


def host_snapshot(
    state_dict: dict[str, Any], optimizers: Iterable[torch.optim.Optimizer] | None = None
) -> dict[str, Any]:
    """``state_dict`` with tensors replaced by a :func:`host_copy`; other values are shared.

    Without ``optimizers`` every tensor is copied. With them, only their live tensors
    (:class:`LiveMemory`) are; the rest are already private and are kept as they are.
    """
    if optimizers is None:
        copied: dict[str, Any] = tree_map_only(torch.Tensor, host_copy, state_dict)
        return copied
    live = LiveMemory(optimizers)
    private: dict[str, Any] = tree_map_only(
        torch.Tensor, lambda tensor: host_copy(tensor) if tensor in live else tensor, state_dict
    )
    return private


def private_destinations(state_dict: dict[str, Any], optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, Any]:
    """``state_dict`` with every live tensor of the optimizers replaced by a fresh host tensor.

    The fresh tensors have the live ones' shapes, dtypes and (DTensor) layouts and are left
    uninitialized: they are destinations for a load, which overwrites every element of every entry
    it plans (DCP refuses a checkpoint missing one before it reads). Other values are shared.
    """
    live = LiveMemory(optimizers)
    private: dict[str, Any] = tree_map_only(
        torch.Tensor, lambda tensor: host_empty_like(tensor) if tensor in live else tensor, state_dict
    )
    return private


def private_host_bytes(state_dict: dict[str, Any], optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Host bytes held by the tensors of ``state_dict`` that are not the optimizers' live state.

    Each storage counts once, whole (a view keeps all of it alive); a DTensor counts its local shard.
    """
    live = LiveMemory(optimizers)
    sizes: dict[int, int] = {}
    for leaf in tree_leaves(state_dict):
        if isinstance(leaf, torch.Tensor) and leaf not in live and _local(leaf).device.type == "cpu":
            storage = _local(leaf).untyped_storage()
            sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def host_empty_like(tensor: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialized host tensor like ``tensor`` (a DTensor: of its layout, with a host local shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return _like_dtensor(tensor, torch.empty_like(tensor.to_local(), dtype=dtype, device="cpu"))
    return torch.empty_like(tensor.detach(), dtype=dtype, device="cpu")


def _like_dtensor(tensor: Any, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor of ``tensor``'s mesh, placements, global shape and strides."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
