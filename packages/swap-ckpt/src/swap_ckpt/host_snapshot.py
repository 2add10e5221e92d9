"""Private host copies of optimizer state dicts, so DCP never reads or writes the live host mirrors.

``SwapOptimizer.state_dict()`` hands out its host mirrors themselves. DCP uses
the tensors it gets both as the source of a save (an async save may still read
them while the next ``step()`` rewrites them) and as the destination of a load
(it writes into them before ``load_state_dict`` can check anything). A copy
in host memory decouples both: the cost is one host memcpy of the optimizer
state, never device memory.

Tensors that are already private need no copy: distributed Muon's per-shard
momentum is exported into fresh tensors, and so is a full or CPU-offloaded
state dict. Given the optimizers, :func:`host_snapshot` copies only what shares
storage with their live state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = ["host_copy", "host_snapshot", "live_storages"]


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor``; a DTensor stays a DTensor of the same layout over a copied local shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        local = tensor.to_local().to("cpu", copy=True)
        return DTensor.from_local(
            local,
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
    return tensor.detach().to("cpu", copy=True)


def live_storages(optimizers: Iterable[torch.optim.Optimizer]) -> frozenset[tuple[torch.device, int]]:
    """Where the optimizers' live tensors keep their bytes: every state entry and tensor hyper-parameter.

    Keys are (device, storage address) of the local tensor (a DTensor's shard), so two views of one
    buffer, such as the host mirrors of a packed swap buffer, share a key.
    """
    keys: set[tuple[torch.device, int]] = set()
    for optimizer in optimizers:
        values: list[Any] = list(optimizer.state.values())
        values += [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
        for leaf in tree_leaves(values):
            if isinstance(leaf, torch.Tensor):
                keys.add(_storage_key(leaf))
    return frozenset(keys)


def host_snapshot(
    state_dict: dict[str, Any], optimizers: Iterable[torch.optim.Optimizer] | None = None
) -> dict[str, Any]:
    """``state_dict`` with tensors replaced by a :func:`host_copy`; other values are shared.

    Without ``optimizers`` every tensor is copied. With them, only tensors that share storage with
    their live state (:func:`live_storages`) are; the rest are already private and are kept as
    they are, which saves a host copy of them.
    """
    if optimizers is None:
        copied: dict[str, Any] = tree_map_only(torch.Tensor, host_copy, state_dict)
        return copied
    live = live_storages(optimizers)

    def copy_if_live(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        # An empty storage has no address to compare (0): copy it, which costs nothing.
        return host_copy(tensor) if key in live or key[1] == 0 else tensor

    private: dict[str, Any] = tree_map_only(torch.Tensor, copy_if_live, state_dict)
    return private


def _storage_key(tensor: torch.Tensor) -> tuple[torch.device, int]:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.device, local.untyped_storage().data_ptr()
