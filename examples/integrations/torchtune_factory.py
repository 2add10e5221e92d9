"""torchtune: point the config's ``optimizer._component_`` at a factory that wraps AdamW.

torchtune builds the optimizer with ``config.instantiate(cfg.optimizer, model.parameters())``:
the component gets the parameters first and the config's other keys as keywords. A recipe config
then reads::

    optimizer:
      _component_: torchtune_factory.swapped_adamw   # this module, importable by the recipe
      lr: 2e-5
      fused: True
      swap:                                          # SwapConfig's fields, all optional
        swap_times: 16

Keep ``optimizer_in_bwd: False`` (the default): stepping inside backward hooks creates one
optimizer per parameter, which leaves nothing to stream in batches. To step inside the backward,
swapped, set ``swap: {step: in_backward}`` instead: each batch of states updates from the gradient
hooks as soon as its gradients are final. That mode refuses ``clip_grad_norm`` and
``gradient_accumulation_steps`` above 1 (torchtune's loop runs its micro-batches' backwards without
``opt.accumulating()``), at the first step, before anything changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer


def swapped_adamw(
    params: Iterable[Any], *, swap: Mapping[str, Any] | SwapConfig | None = None, **adamw: Any
) -> SwapOptimizer:
    """``torch.optim.AdamW(params, **adamw)`` with its states swapped.

    ``swap`` holds SwapConfig's fields as the config file's mapping, or is a SwapConfig.
    """
    config = swap if isinstance(swap, SwapConfig) else SwapConfig(**dict(swap or {}))
    return swap_optimizer(torch.optim.AdamW(params, **adamw), config)
