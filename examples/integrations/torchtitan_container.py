"""torchtitan: an ``OptimizersContainer`` subclass that wraps each optimizer it builds.

torchtitan builds one optimizer per model part (pipeline stage) and optimizer type inside
``OptimizersContainer``; its ``step``, ``zero_grad`` and flat FQN-keyed ``state_dict`` /
``load_state_dict`` go through ``self.optimizers``. Wrapping each of them after the container
has built them keeps all of that, and the container's own hooks::

    optimizer = SwappedOptimizersContainer.Config(param_groups=default_adamw(lr=3e-4).param_groups)
    optimizers = optimizer.build(model_parts=model_parts)

``swap=SwapConfig(step="in_backward")`` is the swapped counterpart of torchtitan's early step in
backward (``OptimizersInBackwardContainer``, one optimizer per parameter): each optimizer's batches
update from the gradient hooks. That mode refuses gradient clipping (``max_norm``) and gradient
accumulation without ``opt.accumulating()`` at the first step, before anything changes.
"""

from __future__ import annotations

import dataclasses

from torch import nn
from torchtitan.components.optimizer import OptimizersContainer

from swap_core import SwapConfig, swap_optimizer


class SwappedOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container with every optimizer's states swapped (``Config.swap``)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        swap: SwapConfig = dataclasses.field(default_factory=SwapConfig)
        """How the states are swapped; one SwapConfig for every optimizer of the container."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        super().__init__(config, model_parts=model_parts)
        self.optimizers = [swap_optimizer(optimizer, config.swap) for optimizer in self.optimizers]
