"""swap-generic: any per-parameter torch optimizer with its states in pinned host memory between steps.

Installing this package registers :class:`GenericAdapter` for ``torch.optim.Optimizer`` through the
``swap_core.adapters`` entry point: every optimizer without a dedicated adapter (SGD, Adagrad, NAdam,
RAdam, Rprop, Adafactor...) is swapped by running its own ``step`` batch by batch::

    opt = swap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), swap_times=16)
"""

from __future__ import annotations

from .__about__ import __version__
from .adapter import NOT_PER_PARAMETER, GenericAdapter, register

__all__ = ["NOT_PER_PARAMETER", "GenericAdapter", "__version__", "register"]
