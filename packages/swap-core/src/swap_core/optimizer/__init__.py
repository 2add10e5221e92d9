"""The middle floor: :class:`SwapOptimizer`, the torch face, and the rooms it delegates to.

- ``swap_optimizer``: the torch face (construction, the step driver of ``SwapConfig.step``, ``step()``, state
  dicts, param groups, copies); ``prefetching``: ``prefetch()``.
- ``wrapping``: what is refused before wrapping changes anything, and swap's hooks on the wrapped optimizer.
- ``swapping`` and ``setup``: what the face swaps with, and every mode decided once at wrapping (``batch_count``:
  how many batches; ``state_creation``: when missing states are made).
- ``state_sync``: the wrapped optimizer's ``state`` and ``param_groups`` followed into the swap runtime
  (tracked state, the store, the parameter order) under one generation counter.
- ``plan_cache``: the swap plan, rebuilt when that generation moves.
- ``step_driver``: the step skeleton and its driver after the backward; ``in_backward``: the driver inside it.
- ``step_run``: one ``step()``'s work on the batches.
- ``loading``: ``load_state_dict`` and states taken over without masters.
- ``outside_step``: the wrapped optimizer's methods that run outside ``step()``.
"""

from .swap_optimizer import SwapOptimizer

__all__ = ["SwapOptimizer"]
