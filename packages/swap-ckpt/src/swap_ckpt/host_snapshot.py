"""Private host copies of optimizer state dicts, so DCP never reads or writes the live host mirrors.

``SwapOptimizer.state_dict()`` hands out its host mirrors themselves. DCP uses
the tensors it gets both as the source of a save (an async save may still read
them while the next ``step()`` rewrites them) and as the destination of a load
(it writes into them before ``load_state_dict`` can check anything). A copy
in host memory decouples both: the cost is one host memcpy of the optimizer
state, never device memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only

__all__ = ["host_copy", "host_snapshot"]


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


def host_snapshot(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every tensor replaced by a :func:`host_copy`; other values are shared."""
    copied: dict[str, Any] = tree_map_only(torch.Tensor, host_copy, state_dict)
    return copied
