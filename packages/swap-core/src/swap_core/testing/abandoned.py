"""A step begun inside the backward and abandoned, beside a plain twin that skipped that iteration.

The loop runs a few iterations on both, then one more backward on the swapped model only, whose batches update
inside it; then it abandons the step: ``zero_grad()`` without ``step()``, or the optimizer dropped and collected
(``del opt; gc.collect()``). Either way the step is taken back: the caller compares the parameters (first: a host
read of the state takes an open step back by itself) and the wrapped optimizer's state with the twin's.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any, Literal

import torch

from ..config import SwapConfig
from ..wrap import swap_optimizer

__all__ = ["Abandoned", "abandon_a_step_begun_inside_the_backward"]

Ending = Literal["zero_grad", "collected"]


class Abandoned:
    """What the caller compares: the twin's model and optimizer, and the swapped model with the optimizer it
    wrapped (the swapped one is gone when ``ending`` was ``"collected"``)."""

    def __init__(
        self, twin_model: torch.nn.Module, twin: torch.optim.Optimizer, model: torch.nn.Module, wrapped: Any
    ) -> None:
        self.twin_model, self.twin, self.model, self.wrapped = twin_model, twin, model, wrapped


def abandon_a_step_begun_inside_the_backward(
    model: torch.nn.Module,
    make: Callable[[torch.nn.Module], torch.optim.Optimizer],
    config: SwapConfig,
    ending: Ending,
    inputs: torch.Tensor,
    *,
    iterations: int = 3,
) -> Abandoned:
    """``iterations`` of both loops over ``inputs`` (``make(model)`` builds an optimizer over a model; ``config`` steps
    inside the backward; the loss is the sum of the squared outputs), one more backward on the swapped one, then its
    step abandoned by ``ending``. Asserts that some batch updated inside a backward."""
    twin_model = copy.deepcopy(model)
    twin, wrapped = make(twin_model), make(model)
    swapped = swap_optimizer(wrapped, config)
    in_backward = 0
    for _ in range(iterations):
        for some_model, optimizer in ((twin_model, twin), (model, swapped)):
            some_model(inputs).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        in_backward += swapped.stats.batches_in_backward
    assert in_backward > 0, "no batch updated inside a backward: nothing would be abandoned"
    model(inputs).pow(2).sum().backward()  # its batches update inside the backward
    if ending == "zero_grad":
        swapped.zero_grad()
    else:
        del swapped, optimizer  # every name of it: nothing else holds it
        gc.collect()
    return Abandoned(twin_model, twin, model, wrapped)
