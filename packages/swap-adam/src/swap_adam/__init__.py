"""swap-adam: ``torch.optim.Adam`` and ``AdamW`` with their moments in pinned host memory between steps.

Installing this package registers :class:`AdamAdapter` through the
``swap_core.adapters`` entry point, so ``swap_core.swap_optimizer`` finds it::

    opt = swap_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), swap_times=16)
"""

from __future__ import annotations

from .__about__ import __version__
from .adapter import AdamAdapter, register
from .validation import ADAM_STATE_KEYS

__all__ = ["ADAM_STATE_KEYS", "AdamAdapter", "__version__", "register"]
