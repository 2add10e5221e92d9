"""Which new states go to host memory: their key, dtype and size allow it, and ``offload_fraction`` of the bytes
that could is not exceeded (each decision booked, so that the fraction holds over every state decided so far)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..adapters.base import StateInit
from ..dtensor import local_tensor
from ..master_weights.remainder import remainder_numel
from .slots import is_swappable, is_swappable_dtype
from .state_keys import REMAINDER_KEY

__all__ = ["SwapDecisions"]


@dataclasses.dataclass
class SwapDecisions:
    """The decisions of one store (see the module)."""

    swap_keys: frozenset[str] | None
    """The keys that may be swapped (``None``: every key, for an adapter that knows no key names in advance)."""
    min_numel: int
    offload_fraction: float
    swapped_bytes: int = 0
    """Bytes of the states decided swapped (and not forgotten since)."""
    candidate_bytes: int = 0
    """Bytes of the states that could have been."""

    def should_swap(self, key: str, template: torch.Tensor | StateInit) -> bool:
        """Whether a new state goes to host memory; books it against ``offload_fraction``."""
        nbytes = self.eligible_bytes(key, template)
        if nbytes is None:
            return False
        self.candidate_bytes += nbytes
        if self.swapped_bytes + nbytes > self.offload_fraction * self.candidate_bytes:
            return False
        self.swapped_bytes += nbytes
        return True

    def would_swap(
        self, fresh: Sequence[tuple[torch.Tensor, str, StateInit]]
    ) -> list[tuple[torch.Tensor, str, StateInit]]:
        """Those of ``fresh`` (``(parameter, key, template)``) that :meth:`should_swap` would send to host memory, one
        after the other, without booking anything."""
        booked = dataclasses.replace(self)
        return [(param, key, template) for param, key, template in fresh if booked.should_swap(key, template)]

    def forget(self, nbytes: int) -> None:
        """A swapped state of ``nbytes`` is gone."""
        self.swapped_bytes -= nbytes
        self.candidate_bytes -= nbytes

    def eligible_bytes(self, key: str, template: torch.Tensor | StateInit) -> int | None:
        """The bytes of a state that may be swapped (its key, dtype and size allow it), else ``None``."""
        if self.swap_keys is not None and key not in self.swap_keys:
            return None
        if isinstance(template, StateInit):
            numel, dtype = torch.Size(template.shape).numel(), template.dtype
            movable = is_swappable_dtype(dtype)
        else:
            local = local_tensor(template)
            numel, dtype = local.numel(), local.dtype
            movable = is_swappable(local, min_numel=0)  # its dtype and layout; its size is checked below
        # A master's remainder counts as many elements as its master for min_numel (it goes with the moments).
        counted = remainder_numel(numel) if key == REMAINDER_KEY else numel
        return numel * dtype.itemsize if movable and counted >= max(self.min_numel, 1) else None
