"""``prefetch()``: the first batches' copy-ins issued ahead of ``step()``, by the user or, with
``SwapConfig(prefetch="backward")``, from the backward's gradient hooks (:mod:`swap_core.backward_prefetch`)."""

from __future__ import annotations

from ..backward_prefetch import BackwardPrefetch
from .plan_cache import PlanCache
from .setup import SwapSetup

__all__ = ["Prefetching"]


class Prefetching:
    """Issues the first batch's copy-in of the next step; with ``from_backward``, arms the backward to issue it."""

    def __init__(self, owner: object, setup: SwapSetup, plans: PlanCache, *, from_backward: bool) -> None:
        """The backward's hooks go when ``owner`` (the optimizer) is collected."""
        self.setup = setup
        self.plans = plans
        self._backward = BackwardPrefetch(owner, self._from_backward) if from_backward else None
        self.arm(after_step=False)  # states loaded or deep-copied: the first backward prefetches

    @property
    def prefetched(self) -> bool:
        return self.setup.scheduler.prefetched

    def prefetch(self) -> None:
        """:meth:`SwapOptimizer.prefetch`: idempotent, nothing while the first batch has no state to copy."""
        scheduler = self.setup.scheduler
        if scheduler.prefetched:
            return
        with scheduler.working():
            plan = self.plans.current()
            if not plan.batches or not plan.batches[0].slots:  # nothing to copy in yet: the first step makes the states
                return
            self.setup.backend.start_transfer_window()
            scheduler.prefetch(plan)

    def _from_backward(self) -> None:
        """:meth:`prefetch` from a gradient hook: on the stream the steps run on, whatever stream the hook runs under
        (FSDP2 runs post-accumulate-grad hooks under its post-reduce stream: staging allocated there would belong
        to that stream's pool, and the copy-in, ordered after the step's stream only, could overwrite a block the
        reduce-scatter still reads)."""
        with self.setup.backend.stream(self.setup.scheduler.compute):
            self.prefetch()

    def arm(self, *, after_step: bool) -> None:
        """``prefetch="backward"``: the next backward prefetches once the first batch's gradients are final.

        Awaited are the parameters of the batch the next step walks first that had a gradient in the step
        that just ran (``after_step``; before any step: those that require one). See
        :mod:`swap_core.backward_prefetch` for the rules and why an early prefetch stays right. Nothing without
        ``from_backward``.
        """
        if self._backward is None:
            return
        plan = self.plans.current()
        first = [param for _, param in plan.batches[0].params] if plan.batches else []
        self._backward.arm(param for param in first if (param.grad is not None if after_step else param.requires_grad))
