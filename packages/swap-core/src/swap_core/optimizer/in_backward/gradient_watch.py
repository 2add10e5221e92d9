"""Gradients noted as a backward left them, to tell at ``step()`` which were edited since (``step="in_backward"``)."""

from __future__ import annotations

import torch

from ...dtensor import local_tensor
from ...torch_compat import tensor_version

__all__ = ["GradientWatch"]


class GradientWatch:
    """Each noted parameter's gradient and its version (of a DTensor's local shard); :meth:`changed` lists those
    replaced or written in place since, and those set again after :meth:`drop`."""

    def __init__(self) -> None:
        self._noted: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = {}

    def __contains__(self, param: torch.Tensor) -> bool:
        return id(param) in self._noted

    def note(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """``grad``, ``param``'s gradient now (noting it again replaces what was noted)."""
        self._noted[id(param)] = (param, grad, tensor_version(local_tensor(grad)))

    def drop(self, param: torch.Tensor) -> bool:
        """``param.grad = None`` and forget the gradient (a gradient there later counts as changed); whether it was
        noted and not dropped already."""
        noted = self._noted.get(id(param))
        if noted is None or noted[1] is None:
            return False
        param.grad = None
        self._noted[id(param)] = (param, None, noted[2])
        return True

    def changed(self) -> list[torch.Tensor]:
        """The parameters whose gradient is not the one noted, as noted (in the order noted)."""
        edited = []
        for param, grad, version in self._noted.values():
            if grad is None:  # dropped: any gradient there now was set since
                changed = param.grad is not None
            else:
                changed = param.grad is not grad or tensor_version(local_tensor(grad)) != version
            if changed:
                edited.append(param)
        return edited
