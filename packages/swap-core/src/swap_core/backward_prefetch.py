"""``SwapConfig(prefetch="backward")``: the first batch's copy-in starts from the backward's gradient hooks.

The contract, in one place:

- After each ``step()`` the optimizer *arms* the trigger with the parameters of the batch its next step walks
  first (the last parameters of the param groups: that plan walks its batches in reverse) that had a gradient
  in that step. A post-accumulate-grad hook on each of them marks it final when the backward has accumulated
  its gradient (FSDP2 runs these hooks on the sharded parameter after its reduce-scatter); when all are final,
  the trigger calls ``prefetch()`` once and disarms until the next step.
- Gradient accumulation (several backwards per step) prefetches during the first of them. That copy-in is
  still right for the step that follows the last one: it reads host states only, never gradients, and host
  states change between steps only through the optimizer (a load or an edit of ``state`` or
  ``param_groups``, after which the step drops the prefetch and runs as without it). The price is holding
  the staging memory of the batches it copies in (the first one with two staging buffers) from that first
  backward on.
- A parameter that had no gradient in the last step is not waited for; one that stops getting gradients only
  means that no prefetch is issued (the step then copies batch 0 in itself). The result never depends on when,
  or whether, the prefetch ran.
- The hooks hold the optimizer weakly and are removed when it is garbage collected; a deep copy registers its
  own. With ``prefetch="off"`` nothing is registered.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["BackwardPrefetch"]

_LOG = logging.getLogger("swap_core")


class BackwardPrefetch:
    """Calls ``prefetch`` once every armed parameter's gradient is final in the backward after a step."""

    def __init__(self, owner: object, prefetch: Callable[[], None]) -> None:
        """``prefetch`` is a bound method of ``owner``, held weakly; the hooks go when ``owner`` is collected."""
        self._prefetch = weakref.WeakMethod(prefetch)
        self._hooks: dict[int, tuple[torch.Tensor, RemovableHandle]] = {}
        self._pending: set[int] = set()
        self._armed = False
        weakref.finalize(owner, BackwardPrefetch.remove, self)

    @property
    def armed(self) -> bool:
        """Whether the next backward is to issue the prefetch (some awaited gradient is not final yet)."""
        return self._armed

    def arm(self, params: Iterable[torch.Tensor]) -> None:
        """Prefetch once each of ``params`` (those that can have a gradient hook) has its gradient finalized."""
        awaited = {id(param): param for param in params if _hookable(param)}
        for key in [key for key in self._hooks if key not in awaited]:
            self._hooks.pop(key)[1].remove()
        for key, param in awaited.items():
            if key not in self._hooks:
                hook = param.register_post_accumulate_grad_hook(self._gradient_final)  # type: ignore[no-untyped-call]
                self._hooks[key] = (param, hook)
        self._pending = set(awaited)
        self._armed = bool(awaited)

    def disarm(self) -> None:
        """Issue nothing until the next :meth:`arm`."""
        self._pending = set()
        self._armed = False

    def remove(self) -> None:
        """Remove every hook (the optimizer is gone)."""
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks = {}
        self.disarm()

    def _gradient_final(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        self._pending.discard(id(param))
        if self._pending:
            return
        self._armed = False
        prefetch = self._prefetch()
        if prefetch is None:
            return
        try:
            prefetch()
        except Exception as error:
            # Raising here would abort the user's backward half-way. A failed prefetch leaves nothing pending, and
            # the step, which copies batch 0 in itself, meets (and raises) whatever made it fail.
            _LOG.warning("The prefetch issued from the backward failed (%s); the step runs without it", error)


def _hookable(param: torch.Tensor) -> bool:
    """Whether autograd accumulates a gradient into ``param`` (a leaf that requires one)."""
    return param.requires_grad and param.is_leaf
