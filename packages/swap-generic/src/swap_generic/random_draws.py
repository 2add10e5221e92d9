"""Whether an optimizer's step draws random numbers, told by the generators its probe twin's steps advanced.

A step that draws (SGLD-style noise ``torch.randn_like(p)`` per parameter, a state initialised from the RNG) gives
each draw to the parameter it is updating: swapped, the draws land where torch's step puts them only when the
parameters update in torch's order. The probe watches, around a twin's steps over its stand-ins, every generator
such a step can draw from:

- the default CPU generator (``torch.get_rng_state()``);
- the default generator of the stand-ins' accelerator (``torch.get_device_module(type).get_rng_state(index)``);
- generators of the optimizer's own, reachable from the twin's attributes or param group values (the twin's are
  deep copies: the optimizer's own generators never advance).

Each one whose state changed is named. The twins step under a forked RNG (:mod:`swap_generic.probe`), so the
caller's generators are as they were.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .delegation import reachable_generators

__all__ = ["DrawWatch"]

_StateOf = Callable[[], torch.Tensor]


class DrawWatch:
    """The states of every generator ``twin``'s step could draw from, taken now; :meth:`drawn` names those that
    advanced since."""

    def __init__(self, twin: torch.optim.Optimizer, device: torch.device) -> None:
        self._generators = _generators(twin, device)
        self._before = [state() for _, state in self._generators]

    def drawn(self) -> str | None:
        """The generators drawn from since the watch began (said for an error message), or ``None``."""
        advanced = [
            name
            for (name, state), before in zip(self._generators, self._before, strict=True)
            if not torch.equal(state(), before)
        ]
        return " and ".join(advanced) or None


def _generators(twin: torch.optim.Optimizer, device: torch.device) -> list[tuple[str, _StateOf]]:
    """Each generator ``twin``'s step could draw from, named, with a reader of its state."""
    generators: list[tuple[str, _StateOf]] = [
        ("the default CPU generator (torch.get_rng_state())", torch.get_rng_state)
    ]
    if device.type not in ("cpu", "meta"):
        module, index = torch.get_device_module(device.type), device.index or 0
        generators.append(
            (
                f"the default {device.type}:{index} generator (torch.get_device_module({device.type!r})"
                f".get_rng_state({index}))",
                lambda: module.get_rng_state(index),
            )
        )
    owned = reachable_generators(twin)
    owned += [
        (f"{type(twin).__name__}.param_groups[{index}][{key!r}]", value)
        for index, group in enumerate(twin.param_groups)
        for key, value in group.items()
        if isinstance(value, torch.Generator) and all(value is not known for _, known in owned)
    ]
    generators += [(f"its generator at {path}", generator.get_state) for path, generator in owned]
    return generators
