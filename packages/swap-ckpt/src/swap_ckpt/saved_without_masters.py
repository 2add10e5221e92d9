"""A checkpoint saved without master weights, loaded by optimizers with ``master_weights=True``.

The live state of such an optimizer holds a ``"master_param"`` and fp32 states for each bf16/fp16
parameter, so it is the wrong load target for a checkpoint saved without master weights: DCP
would refuse the missing masters and cast the saved bf16 states silently while reading. Where the
checkpoint has no master for a parameter, the target drops it and reads the parameter's states in
the dtypes the checkpoint holds. The optimizer's own load then does what a plain checkpoint loaded
into master mode gets everywhere (``SwapOptimizer.load_state_dict``): the masters start as the
loaded parameters, the states are kept in fp32, one warning names how many.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from swap_core.master_weights import MASTER_KEY

from .host_snapshot import host_empty_like

__all__ = ["as_saved_without_masters"]


def as_saved_without_masters(optim: dict[str, Any], metadata: Metadata, prefix: str) -> dict[str, Any]:
    """``optim`` (the optimizer part of a load target, flattened under ``prefix``) for what the checkpoint holds.

    Unchanged when the checkpoint has every master the target asks for (a resume); otherwise a
    shallow copy in which each parameter whose master the checkpoint lacks has none, and its
    tensors of another dtype than the saved ones are fresh host tensors of the saved dtype.
    """
    saved = metadata.state_dict_metadata
    state = optim.get("state", {})
    lacking = [
        name
        for name, entry in state.items()
        if isinstance(entry, dict) and MASTER_KEY in entry and f"{prefix}.state.{name}.{MASTER_KEY}" not in saved
    ]
    if not lacking:
        return optim
    adjusted = dict(state)
    for name in lacking:
        entry = {key: value for key, value in state[name].items() if key != MASTER_KEY}
        for key, value in list(entry.items()):
            stored = saved.get(f"{prefix}.state.{name}.{key}")
            if (
                isinstance(value, torch.Tensor)
                and isinstance(stored, TensorStorageMetadata)
                and stored.properties.dtype != value.dtype
            ):
                entry[key] = host_empty_like(value, dtype=stored.properties.dtype)
        adjusted[name] = entry
    return {**optim, "state": adjusted}
