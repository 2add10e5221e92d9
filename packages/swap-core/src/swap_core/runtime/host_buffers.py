"""Where the swapped states live in host memory, chosen once per store (``SwapConfig.packed``).

- :class:`PackedHostBuffers`: pinned buffers per dtype (:class:`~swap_core.runtime.packed.PackedHost`, in chunks of
  at most the backend's ``max_host_buffer_bytes``), every
  swapped state at a fixed offset in parameter order, so that a batch moves as one copy per dtype. A state a step
  creates on the device gets a buffer of its own meanwhile (the packed ones are in use by that step) until
  :meth:`~swap_core.runtime.store.StateStore.pack` lays it out with the others.
- :class:`TensorHostBuffers`: one pinned buffer per state, each copied on its own.

With ``copies=2`` each keeps a second copy of the same layout, the *spare*: a walk whose updates are provisional
(inside the backward) copies the states out to it, and a commit swaps the two (:meth:`flip`), copying nothing. A
state a running step creates in packed mode gets no spare until it is packed (a plan is never built before).

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
    """One pinned host buffer per swapped state (two with a spare)."""

    packs = False
    """States are never laid out together: adding one lays out nothing else."""
    packed_host: PackedHost | None = None
    spare_host: PackedHost | None = None
    has_unpacked = False

    def __init__(self, backend: DeviceBackend, mode: HostMemoryMode, *, copies: int = 1) -> None:
        self._backend, self._mode, self._copies = backend, mode, copies
        self._pinned: dict[SwapSlot, int] = {}
        """The pinned bytes of each state's buffers."""

    def own_buffer(self, slot: SwapSlot) -> torch.Tensor:
        """A host buffer for ``slot`` alone (1-D, ``slot.numel`` elements); its spare, where kept, in ``slot.spare``."""
        buffers = [self._backend.empty_host(slot.numel, slot.dtype, mode=self._mode) for _ in range(self._copies)]
        self._pinned[slot] = sum(map(self._backend.pinned_bytes, buffers))
        slot.spare = slot.shaped(buffers[1]) if len(buffers) > 1 else None
        return buffers[0]

    def flip(self) -> None:
        """Nothing to swap but each slot's own buffers (the store swaps them)."""

    def forget(self, slot: SwapSlot) -> None:
        self._pinned.pop(slot, None)

    def relayout_bytes(self, slots: Sequence[SwapSlot]) -> int:
        """Nothing is laid out again."""
        return 0

    @property
    def spare_bytes(self) -> int:
        """Host bytes of the spare copies."""
        return sum(slot.nbytes for slot in self._pinned if slot.spare is not None)

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

    def __init__(self, backend: DeviceBackend, mode: HostMemoryMode, *, copies: int = 1) -> None:
        self._backend, self._mode, self._copies = backend, mode, copies
        self.packed_host: PackedHost | None = None
        self.spare_host: PackedHost | None = None
        """The spare copy of the packed buffers (same layout), where kept."""
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
        return self._copies * PackedHost.required_pinned_bytes(slots, self._mode, self._backend.max_host_buffer_bytes)

    def lay_out(self, slots: Sequence[SwapSlot]) -> PackedHost:
        """New buffers holding ``slots`` in this order (the caller fills them, then the old ones go); each slot's view
        of the spare, where kept, in ``slot.spare``."""
        packed = PackedHost(self._backend, slots, mode=self._mode)
        spare = PackedHost(self._backend, slots, mode=self._mode) if self._copies > 1 else None
        for slot in slots:
            slot.spare = spare.view(slot) if spare is not None else None
        self._unpacked.clear()
        self.packed_host, self.spare_host = packed, spare
        return packed

    def flip(self) -> None:
        """The spare buffers become the current ones and the current ones the spare."""
        self.packed_host, self.spare_host = self.spare_host, self.packed_host

    @property
    def spare_bytes(self) -> int:
        """Host bytes of the spare copy."""
        return self.spare_host.nbytes if self.spare_host is not None else 0

    @property
    def pinned_bytes(self) -> int:
        packed = sum(host.pinned_bytes for host in (self.packed_host, self.spare_host) if host is not None)
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


def host_buffers(backend: DeviceBackend, mode: HostMemoryMode, *, packed: bool, copies: int = 1) -> HostBuffers:
    """The host buffers ``SwapConfig.packed`` asks for, with ``copies`` copies of each state (2: a spare)."""
    kind = PackedHostBuffers if packed else TensorHostBuffers
    return kind(backend, mode, copies=copies)
