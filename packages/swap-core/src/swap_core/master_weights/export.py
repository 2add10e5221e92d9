"""A full-precision export of a model trained with master weights."""

from __future__ import annotations

from typing import Any

import torch

from .fp32_view import master_of
from .params import MASTER_DTYPE, has_master

__all__ = ["master_state_dict"]


def master_state_dict(module: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> dict[str, Any]:
    """``module.state_dict()`` with each parameter that has a master replaced by a copy of that fp32 master.

    For a final full-precision export of a model trained with ``master_weights=True``: keys and
    everything else (fp32 parameters, buffers) are ``module.state_dict()``'s; a master is looked up
    in the state of whichever of ``optimizers`` holds the parameter, under every name of a tied
    parameter. A bf16/fp16 parameter without a master (it never had a gradient) is exported as fp32
    too, its own values, so that every parameter of the export is fp32. Each optimizer is synchronized
    first (a swapped master is read from its host mirror); the values are new CPU tensors.
    """
    masters: dict[int, torch.Tensor] = {}
    for optimizer in optimizers:
        for param in [param for group in optimizer.param_groups for param in group["params"]]:
            master = master_of(optimizer, param)  # either form, as fp32
            if master is not None:
                masters[id(param)] = master
    exported = dict(module.state_dict())
    for name, param in module.named_parameters(remove_duplicate=False):  # every name of a tied parameter
        if name not in exported:
            continue
        master = masters.get(id(param))
        if master is not None:
            exported[name] = master.detach().to("cpu", copy=True)
        elif has_master(param):  # never stepped: its master would be itself; fp32 like the others
            exported[name] = param.detach().to("cpu", dtype=MASTER_DTYPE, copy=True)
    return exported
