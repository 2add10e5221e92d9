"""Gradients noted as a backward left them, to tell at ``step()`` which were edited since (``step="in_backward"``).

An edit is told by the gradient's bits, not by its version counter: the counter misses what torch does not count
(``grad.data.mul_``, an extension's kernel such as apex's multi-tensor clipping, and ``torch._foreach_mul_`` on a
DTensor, which ``clip_grad_norm_`` runs under FSDP2: checked, torch 2.13), and counts what changed nothing
(``clip_grad_norm_`` that does not bind multiplies by exactly 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...dtensor import local_tensor
from .gradient_fingerprint import fingerprint

__all__ = ["GradientWatch"]


class GradientWatch:
    """Each noted parameter's gradient and its fingerprint (of a DTensor's local shard); :meth:`changed` lists those
    replaced or whose bits changed since, and those set again after :meth:`drop`."""

    def __init__(self) -> None:
        self._noted: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}

    def __contains__(self, param: torch.Tensor) -> bool:
        return id(param) in self._noted

    def note(self, param: torch.Tensor, grad: torch.Tensor, *, bits: bool = True) -> None:
        """``grad``, ``param``'s gradient now (noting it again replaces what was noted), with its fingerprint
        computed on the current stream, after what wrote it; without ``bits``, only its replacement is told."""
        self._noted[id(param)] = (param, grad, fingerprint(local_tensor(grad)) if bits else None)

    def drop(self, param: torch.Tensor) -> bool:
        """``param.grad = None`` and forget the gradient (a gradient there later counts as changed); whether it was
        noted and not dropped already."""
        noted = self._noted.get(id(param))
        if noted is None or noted[1] is None:
            return False
        param.grad = None
        self._noted[id(param)] = (param, None, None)
        return True

    def changed(self, read_to_host: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """The parameters whose gradient is not the one noted, with the bits noted (in the order noted).
        ``read_to_host`` (``DeviceBackend.read_to_host``) reads the comparison of the fingerprints, once per device
        when any gradient is still there: the host waits for the current stream."""
        replaced: set[int] = set()
        compared: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for param, grad, noted in self._noted.values():
            if grad is None:  # dropped: any gradient there now was set since
                if param.grad is not None:
                    replaced.add(id(param))
            elif param.grad is not grad:
                replaced.add(id(param))
            elif noted is not None:
                now = fingerprint(local_tensor(grad))
                if now.shape != noted.shape:  # resized in place
                    replaced.add(id(param))
                else:
                    compared.setdefault(noted.device, []).append((param, noted, now))
        for entries in compared.values():
            differs = read_to_host(torch.stack([(noted != now).any() for _, noted, now in entries]))
            if differs.is_meta:  # gradients without values (the virtual-clock models): no bits to differ
                continue
            for (param, _, _), changed in zip(entries, differs.tolist(), strict=True):
                if changed:
                    replaced.add(id(param))
        return [param for param, _, _ in self._noted.values() if id(param) in replaced]
