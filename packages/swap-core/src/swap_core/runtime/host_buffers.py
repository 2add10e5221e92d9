"""Where the swapped states live in host memory, chosen once per store (``SwapConfig.packed``).

- :class:`PackedHostBuffers`: one pinned buffer per dtype (:class:`~swap_core.runtime.packed.PackedHost`), every
  swapped state at a fixed offset in parameter order, so that a batch moves as one copy per dtype. A state a step
  creates on the device gets a buffer of its own meanwhile (the packed ones are in use by that step) until
  :meth:`~swap_core.runtime.store.StateStore.pack` lays it out with the others.
- :class:`TensorHostBuffers`: one pinned buffer per state, each copied on its own.

The store asks either the same questions and lays the states out as the answer says.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..backends.host_memory import HostMemoryMode
from ..backends.protocol import DeviceBackend
from .packed import PackedHost
from .slots import SwapSlot

__all__ = ["HostBuffers", "PackedHostBuffers", "TensorHostBuffers", "host_buffers"]


class TensorHostBuffers:
    """One pinned host buffer per swapped state."""

    packs = False
    """States are never laid out together: adding one lays out nothing else."""
    packed_host: PackedHost | None = None
    has_unpacked = False

    def __init__(self, backend: DeviceBackend, mode: HostMemoryMode) -> None:
        self._backend, self._mode = backend, mode
        self._pinned: dict[SwapSlot, int] = {}
        """The pinned bytes of each state's buffer."""

    def own_buffer(self, slot: SwapSlot) -> torch.Tensor:
        """A host buffer for ``slot`` alone (1-D, ``slot.numel`` elements)."""
        buffer = self._backend.empty_host(slot.numel, slot.dtype, mode=self._mode)
        self._pinned[slot] = self._backend.pinned_bytes(buffer)
        return buffer

    def forget(self, slot: SwapSlot) -> None:
        self._pinned.pop(slot, None)

    def relayout_bytes(self, slots: Sequence[SwapSlot]) -> int:
        """Nothing is laid out again."""
        return 0

    def lay_out(self, slots: Sequence[SwapSlot]) -> PackedHost:
        raise AssertionError("per-tensor host buffers are never laid out together")

    @property
    def pinned_bytes(self) -> int:
        return sum(self._pinned.values())

    def host_bytes(self, slots: Iterable[SwapSlot]) -> int:
        """Host bytes of ``slots`` (every slot of the store)."""
        return sum(slot.nbytes for slot in slots)

    def saved(self) -> dict[SwapSlot, int]:
        """What :meth:`restore` puts back (a store's all-or-nothing block)."""
        return dict(self._pinned)

    def restore(self, saved: dict[SwapSlot, int]) -> None:
        self._pinned = saved


class PackedHostBuffers:
    """Every swapped state of a dtype in one pinned buffer, in parameter order; states a running step created in
    buffers of their own until they are packed with the others."""

    packs = True
    """Adding states lays every state out again (unless they come from a running step), as does a new order."""

    def __init__(self, backend: DeviceBackend, mode: HostMemoryMode) -> None:
        self._backend, self._mode = backend, mode
        self.packed_host: PackedHost | None = None
        self._unpacked: dict[SwapSlot, int] = {}
        """States given a buffer of their own during a step, with its pinned bytes, until the next layout."""

    @property
    def has_unpacked(self) -> bool:
        """Whether some states still have buffers of their own (a plan must not be built before they are packed)."""
        return bool(self._unpacked)

    def own_buffer(self, slot: SwapSlot) -> torch.Tensor:
        """A host buffer of its own for ``slot``, until the next :meth:`lay_out`."""
        buffer = self._backend.empty_host(slot.numel, slot.dtype, mode=self._mode)
        self._unpacked[slot] = self._backend.pinned_bytes(buffer)
        return buffer

    def forget(self, slot: SwapSlot) -> None:
        self._unpacked.pop(slot, None)

    def relayout_bytes(self, slots: Sequence[SwapSlot]) -> int:
        """The pinned bytes a layout of ``slots`` takes beside the current one (checked before allocating)."""
        return PackedHost.required_pinned_bytes(slots, self._mode)

    def lay_out(self, slots: Sequence[SwapSlot]) -> PackedHost:
        """New buffers holding ``slots`` in this order (the caller fills them, then the old ones go)."""
        packed = PackedHost(self._backend, slots, mode=self._mode)
        self._unpacked.clear()
        self.packed_host = packed
        return packed

    @property
    def pinned_bytes(self) -> int:
        packed = self.packed_host.pinned_bytes if self.packed_host is not None else 0
        return packed + sum(self._unpacked.values())

    def host_bytes(self, slots: Iterable[SwapSlot]) -> int:
        """Host bytes holding ``slots`` (every slot of the store), alignment padding of the packed buffers included."""
        if self.packed_host is None:
            return sum(slot.nbytes for slot in slots)
        return self.packed_host.nbytes + sum(slot.nbytes for slot in self._unpacked)

    def saved(self) -> dict[SwapSlot, int]:
        """What :meth:`restore` puts back (a store's all-or-nothing block)."""
        return dict(self._unpacked)

    def restore(self, saved: dict[SwapSlot, int]) -> None:
        self._unpacked = saved


HostBuffers = PackedHostBuffers | TensorHostBuffers


def host_buffers(backend: DeviceBackend, mode: HostMemoryMode, *, packed: bool) -> HostBuffers:
    """The host buffers ``SwapConfig.packed`` asks for."""
    return PackedHostBuffers(backend, mode) if packed else TensorHostBuffers(backend, mode)
