"""``SwapConfig(step="in_backward")``: the step driver that updates each batch inside the backward, as soon as its
gradients are final (:mod:`.driver`), the run of such a step (:mod:`.run`), and what it checks at ``step()``: the
gradients it used (:mod:`.gradient_watch`) and the hyperparameters it began with (:mod:`.group_snapshot`)."""

from .driver import InBackward

__all__ = ["InBackward"]
