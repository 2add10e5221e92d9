"""The middle floor: :class:`SwapOptimizer`, the torch face, and the rooms it delegates to.

- ``swap_optimizer``: the torch face (construction, ``step()``, prefetch, state dicts, param groups, copies).
- ``wrapping``: what is refused before wrapping changes anything, and swap's hooks on the wrapped optimizer.
- ``state_sync``: the wrapped optimizer's ``state`` and ``param_groups`` followed into the swap runtime
  (tracked state, the store, the parameter order) under one generation counter.
- ``plan_cache``: the swap plan, rebuilt when that generation moves; ``auto_batching`` sizes it with
  ``swap_times="auto"``.
- ``step_run``: one ``step()``'s work on the batches.
- ``loading``: ``load_state_dict`` and states taken over without masters.
- ``outside_step``: the wrapped optimizer's methods that run outside ``step()``.
"""

from .swap_optimizer import SwapOptimizer

__all__ = ["SwapOptimizer"]
