"""Where every optimizer state lives: host mirrors of swapped states, resident device tensors.

The store decides, once per state, whether it is swapped (and keeps its slot) or
stays resident, and owns the host memory of swapped states, laid out as its
:mod:`~swap_core.runtime.host_buffers` say: one packed buffer per dtype, or one
pinned buffer per state. Between steps
``optimizer.state[p][key]`` *is* the host mirror of a swapped state, so
``state_dict()`` exports it without copying and without touching the device.

The host reads and writes host mirrors only once the copies into and out of them
are done: every method that touches an existing mirror (a re-layout reads them
all, a load writes them) first calls ``await_offloads`` (the pipeline's
``synchronize``: after a step, its last offload may still be writing them), and
runs its host work inside the backend's ``host_scope()``, where the simulator
checks it. Adding states from the device (what a step's update created) touches
no existing mirror and waits for nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..adapters.base import StateInit
from ..backends.host_memory import HostMemoryMode, pinned_size
from ..backends.protocol import DeviceBackend, Stream
from ..backends.storage_spans import StorageSpans
from ..dtensor import local_tensor, shard_layout, wrap_local
from ..errors import HostMemoryError, SwapStateError
from .host_buffers import HostBuffers, host_buffers
from .nested_entries import located
from .packed import PackedHost
from .slots import SlotState, SwapSlot, memory_stride, transition
from .swap_decisions import SwapDecisions

__all__ = ["HostLayout", "StateSource", "StateStore", "StoreOptions"]

_STORE_SERIALS = itertools.count()

StateSource = float | torch.Tensor
"""Initial content of a new host mirror: a fill value or a tensor (on the device or the host)."""


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """What lives in host memory, as a read-only snapshot (:meth:`StateStore.host_layout`)."""

    swapped: tuple[tuple[torch.Tensor, frozenset[str]], ...]
    """Each parameter with a swapped state, in no set order, and the keys of its swapped states."""
    packed_dtypes: frozenset[torch.dtype]
    """The dtypes that have a packed host buffer (empty with ``SwapConfig(packed=False)``)."""
    has_unpacked: bool
    """Whether some swapped states still have host buffers of their own (made by a step, packed after it)."""

    def swapped_keys(self, param: torch.Tensor) -> frozenset[str]:
        """The keys of ``param``'s swapped states (empty when none is swapped)."""
        return next((keys for swapped, keys in self.swapped if swapped is param), frozenset())


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """Which states a store swaps and how their host memory is laid out (decided once, at wrapping)."""

    swap_keys: Sequence[str] | None
    """The state keys that may be swapped (``None``: every key, for an adapter that knows no key names ahead)."""
    min_numel: int
    """States with fewer elements stay on the device."""
    offload_fraction: float
    """The share of the swappable bytes that go to host memory."""
    packed: bool
    """One pinned buffer per dtype (each batch moves as one copy per dtype), or one per state."""
    host_memory: HostMemoryMode = "exact"
    spare: bool = False
    """Keep a second host copy of every swapped state (the *spare*, :mod:`~swap_core.runtime.host_buffers`): a walk
    whose updates are provisional copies out to it, and :meth:`StateStore.flip` makes it current."""


class StateStore:
    """Swapped-state slots of every parameter and the host memory behind them."""

    def __init__(
        self,
        backend: DeviceBackend,
        state: Mapping[torch.Tensor, dict[str, Any]],
        options: StoreOptions,
        *,
        copy_stream: Stream,
        await_offloads: Callable[[], None],
    ) -> None:
        """``await_offloads``: blocks the host until every copy into or out of the host mirrors has finished."""
        self._backend = backend
        self._await_offloads = await_offloads
        self._host_memory: HostMemoryMode = options.host_memory
        self._buffers: HostBuffers = host_buffers(
            backend, options.host_memory, packed=options.packed, copies=2 if options.spare else 1
        )
        self._state = state
        keys = frozenset(options.swap_keys) if options.swap_keys is not None else None
        self._decisions = SwapDecisions(keys, options.min_numel, options.offload_fraction)
        self._copy_stream = copy_stream
        self.slots: dict[torch.Tensor, dict[str, SwapSlot]] = {}
        self.version = 0
        """Bumped whenever the set of slots or their host layout changes (plans are rebuilt)."""
        self._serial = next(_STORE_SERIALS)
        self._casts: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(host mirror, host copy of a device source in another dtype): cast by :meth:`_finish_fills`."""

    @property
    def layout_id(self) -> tuple[int, int]:
        """This store and its :attr:`version`, unique in the process: when it changes, host buffers may have been
        replaced (and, with ``host_memory="caching"``, left in torch's pinned cache)."""
        return self._serial, self.version

    def host_layout(self) -> HostLayout:
        """A snapshot of which states are swapped and how their host memory is laid out."""
        return HostLayout(
            swapped=tuple((param, frozenset(slots)) for param, slots in self.slots.items() if slots),
            packed_dtypes=frozenset(self.packed_host.buffers) if self.packed_host is not None else frozenset(),
            has_unpacked=self.has_unpacked,
        )

    def attach(self, state: Mapping[torch.Tensor, dict[str, Any]]) -> None:
        """Write host mirrors into ``state`` from now on (used to stage a load, then commit it)."""
        self._state = state

    # -- deciding -------------------------------------------------------------
    def should_swap(self, key: str, template: torch.Tensor | StateInit) -> bool:
        """Whether a new state goes to host memory; books it against ``offload_fraction``."""
        return self._decisions.should_swap(key, template)

    def check_room_for(
        self, fresh: Sequence[tuple[torch.Tensor, str, StateInit]], order: Sequence[torch.Tensor]
    ) -> None:
        """Refuse, before a step creates them, the states ``fresh`` (``(parameter, key, template)``) if host memory
        cannot take those of them that would be swapped: each in a buffer of its own while the step runs, then, in
        packed mode, the whole layout re-packed beside them. Nothing is booked or allocated."""
        swapped = self._decisions.would_swap(fresh)
        new = [SwapSlot.whole(param, key, template.shape, template.dtype) for param, key, template in swapped]
        if not new:
            return
        needed = sum(pinned_size(slot.nbytes, self._host_memory) for slot in new)
        needed += self._buffers.relayout_bytes([*self.ordered_slots(order), *new])
        self._check_host_capacity(needed)

    def resident_value(self, template: StateInit, param: torch.Tensor) -> torch.Tensor:
        """A resident device tensor for a fresh state that is not swapped (sharded and laid out like ``param``)."""
        local = local_tensor(param)
        like_param = template.shard_like_param and tuple(template.shape) == tuple(param.shape)
        layout = shard_layout(param) if template.shard_like_param else None
        shape = local.shape if layout is not None else torch.Size(template.shape)
        tensor = self._empty(shape, template.dtype, memory_stride(local) if like_param else None)
        tensor.fill_(template.fill)
        return wrap_local(tensor, layout)

    def resident_copy(self, value: torch.Tensor) -> torch.Tensor:
        """A resident device copy of a loaded state that is not swapped, in the loaded tensor's layout."""
        local = local_tensor(value)
        tensor = self._empty(local.shape, local.dtype, memory_stride(local))
        tensor.copy_(local)
        return wrap_local(tensor, shard_layout(value))

    def _empty(self, shape: torch.Size, dtype: torch.dtype, stride: tuple[int, ...] | None) -> torch.Tensor:
        if stride is None:
            return self._backend.empty(shape, dtype)
        return self._backend.empty((shape.numel(),), dtype).as_strided(shape, stride)

    @contextlib.contextmanager
    def all_or_nothing(self) -> Iterator[None]:
        """Decisions (:meth:`should_swap`) and slots added in the block are undone if it raises."""
        saved = (
            dataclasses.replace(self._decisions),
            {param: dict(slots) for param, slots in self.slots.items()},
            self._buffers.saved(),
        )
        try:
            yield
        except BaseException:
            self._decisions, self.slots, own_buffers = saved
            self._buffers.restore(own_buffers)
            raise

    # -- creating -------------------------------------------------------------
    def add(
        self, new: Sequence[tuple[SwapSlot, StateSource]], order: Sequence[torch.Tensor], *, unpacked: bool = False
    ) -> None:
        """Give new slots host mirrors filled from their sources; ``order`` is the parameter order.

        ``unpacked``: in packed mode, give them host buffers of their own for now (no re-layout of the
        other slots, whose host mirrors may be in use by a running step); :meth:`pack` packs them.
        """
        if not new:
            return
        relayout = self._buffers.packs and not unpacked
        if relayout or any(self._on_host(source) for _, source in new):
            self._await_offloads()  # host mirrors are read (a re-layout copies them; a source may be one)
        for slot, _ in new:
            self.slots.setdefault(slot.param, {})[slot.key] = slot
        # Device sources were written on the compute stream; the copy stream must see those writes.
        self._backend.wait_event(self._copy_stream, self._backend.record_event(self._backend.compute_stream()))
        with self._backend.host_scope():
            if relayout:  # the re-layout packs every slot, those added unpacked too
                self._relayout(order, dict((slot, source) for slot, source in new))
            else:
                self._check_host_capacity(sum(pinned_size(slot.nbytes, self._host_memory) for slot, _ in new))
                for slot, source in new:
                    slot.host = slot.shaped(self._buffers.own_buffer(slot))
                    slot.device = slot.shaped(self._backend.empty((slot.numel,), slot.dtype))
                    self._backend.release_storage(slot.device)
                    self._fill(slot.host, source)
                    self._publish(slot)
            self._finish_fills()
        transition((slot for slot, _ in new), SlotState.PENDING, SlotState.HOST)
        self.version += 1

    def load_in_place(
        self, new: Sequence[tuple[SwapSlot, StateSource]], state: Mapping[torch.Tensor, dict[str, Any]]
    ) -> bool:
        """Write loaded values into the current host mirrors when ``new`` has exactly the current slots.

        Every slot must match one of ``new`` in parameter, key, shape, dtype, strides and shard
        layout, and no other slot may exist; then each source is copied into its live mirror (a source
        that *is* the mirror, as when DCP loaded into it, is left as it is) and the mirrors are
        published in ``state``: no host memory is allocated. Returns ``False`` with nothing changed
        otherwise (the caller builds a new layout).
        """
        current = {(id(slot.param), slot.key): slot for slots in self.slots.values() for slot in slots.values()}
        if len(current) != len(new):
            return False
        pairs: list[tuple[SwapSlot, StateSource]] = []
        for loaded, source in new:
            live = current.get((id(loaded.param), loaded.key))
            if live is None or not _same_place(live, loaded):
                return False
            pairs.append((live, source))
        self._await_offloads()  # the live mirrors are written
        host_buffers = StorageSpans(live.host_mirror for live, _ in pairs)
        fills: list[tuple[SwapSlot, StateSource]] = []
        with self._backend.host_scope():
            for live, source in pairs:
                if isinstance(source, torch.Tensor):
                    local = local_tensor(source)
                    if _is_view_of(local, live.host_mirror):
                        continue
                    if local in host_buffers:
                        source = local.clone()  # another state's mirror (a permuted state dict): read before any write
                fills.append((live, source))
            for live, source in fills:
                self._fill(live.host_mirror, source)
            self._finish_fills()
        for live, _ in pairs:
            container, key = located(state[live.param], live.key)
            container[key] = live.host_value
        return True

    @property
    def packed_host(self) -> PackedHost | None:
        """The packed host buffers (``None`` with per-tensor ones, or before the first layout)."""
        return self._buffers.packed_host

    @property
    def spare_host(self) -> PackedHost | None:
        """The spare copy of the packed host buffers (``None`` without one, or with per-tensor ones)."""
        return self._buffers.spare_host

    @property
    def has_unpacked(self) -> bool:
        """Whether a packed store holds slots added ``unpacked`` (a plan must not be built before :meth:`pack`)."""
        return self._buffers.has_unpacked

    def pack(self, order: Sequence[torch.Tensor]) -> None:
        """Pack the slots added ``unpacked`` with the others; every offload must have finished."""
        if self.has_unpacked:
            self.reorder(order)

    def remove(self, params: Iterable[torch.Tensor]) -> None:
        """Forget the slots of ``params`` (their entries in ``state`` were reset or replaced); call :meth:`reorder`
        or :meth:`add` next to re-pack the host buffers. Their host buffers may be freed: the copies into them
        are waited for first."""
        self._await_offloads()
        for param in params:
            for slot in self.slots.pop(param, {}).values():
                self._decisions.forget(slot.nbytes)
                self._buffers.forget(slot)
        self.version += 1

    def reorder(self, order: Sequence[torch.Tensor]) -> None:
        """Re-pack host buffers so that slots follow ``order`` (after param groups changed)."""
        kept = set(order)
        self.remove([param for param in self.slots if param not in kept])
        if self._buffers.packs:
            self._await_offloads()  # the re-layout reads every host mirror
            with self._backend.host_scope():
                self._relayout(order, {})
                self._finish_fills()
        self.version += 1

    def rekey(self, new_to_old: Mapping[torch.Tensor, torch.Tensor]) -> None:
        """Move slots from old parameter objects to the new ones replacing them."""
        for new, old in new_to_old.items():
            slots = self.slots.pop(old, None)
            if slots is None:
                continue
            for slot in slots.values():
                slot.param = new
            self.slots[new] = slots
        self.version += 1

    def ordered_slots(self, order: Iterable[torch.Tensor]) -> list[SwapSlot]:
        return [slot for param in order for slot in self.slots.get(param, {}).values()]

    def _relayout(self, order: Sequence[torch.Tensor], sources: dict[SwapSlot, StateSource]) -> None:
        slots = self.ordered_slots(order)
        self._check_host_capacity(self._buffers.relayout_bytes(slots))
        packed = self._buffers.lay_out(slots)
        for slot in slots:
            view = packed.view(slot)
            source = sources.get(slot)
            if source is None:  # an existing slot keeps its current host values
                source = slot.host_mirror
            self._fill(view, source)
            slot.host = view
            self._publish(slot)

    def _publish(self, slot: SwapSlot) -> None:
        """Make the slot's host mirror the value ``optimizer.state`` shows between steps."""
        slot.host_value = wrap_local(slot.host_mirror, slot.layout)
        container, key = located(self._state[slot.param], slot.key)
        container[key] = slot.host_value

    def _on_host(self, source: StateSource) -> bool:
        """Whether ``source`` is host memory (a host mirror, say) rather than a fill value or a device tensor."""
        return isinstance(source, torch.Tensor) and not self._backend.owns(local_tensor(source))

    def _fill(self, host: torch.Tensor, source: StateSource) -> None:
        if isinstance(source, float):
            host.fill_(source)
            return
        local = local_tensor(source)
        if not self._backend.owns(local):
            host.copy_(local)
        elif local.dtype == host.dtype:
            self._backend.copy(host, local, stream=self._copy_stream)
        else:
            # Another dtype on the device (an fp32 master filled from its bf16 parameter): copied as it is into
            # host memory of its own and cast there once the copies finished, so no device memory is needed.
            staging = self._backend.empty_host(local.numel(), local.dtype, mode=self._host_memory).view(local.shape)
            self._backend.copy(staging, local, stream=self._copy_stream)
            self._casts.append((host, staging))

    def _finish_fills(self) -> None:
        self._backend.synchronize()
        casts, self._casts = self._casts, []
        for host, staging in casts:
            host.copy_(staging)

    def _check_host_capacity(self, needed: int) -> None:
        """Refuse, before allocating, pinned host memory the host does not have (nothing is allocated)."""
        available = self._backend.available_host_bytes()
        if available is None or needed <= available:
            return
        held = self.host_pinned_bytes
        message = (
            f"Swapping needs {_gib(needed)} of pinned host memory for this rank's optimizer states "
            f"(host_memory={self._host_memory!r}), but the host has {_gib(available)} available"
        )
        if held:
            message += f" (the current layout, {_gib(held)}, is held until the new one is filled)"
        message += (
            ". Nothing was allocated. Keep more state on the device (offload_fraction < 1, or fewer state_keys), "
            "or spread the states over more ranks (FSDP2 shards them)"
        )
        if self._host_memory == "caching":
            message += "; host_memory='exact' pins less than 'caching', which rounds each buffer up to a power of two"
        raise HostMemoryError(message)

    # -- reporting ------------------------------------------------------------
    def flip(self) -> None:
        """The spare copy of every swapped state becomes its host mirror, and the mirror its spare (a walk copied
        every state out to the spare and its step commits): ``state`` shows the new mirrors; nothing is copied."""
        for slots in self.slots.values():
            for slot in slots.values():
                if slot.spare is None:
                    raise SwapStateError(f"{slot!r} has no spare copy to make current")
                slot.host, slot.spare = slot.spare, slot.host
                self._publish(slot)
        self._buffers.flip()

    @property
    def spare_bytes(self) -> int:
        """Host bytes of the spare copies (0 without them)."""
        return self._buffers.spare_bytes

    @property
    def host_pinned_bytes(self) -> int:
        """Host bytes pinned for the swapped states, rounding included."""
        return self._buffers.pinned_bytes

    @property
    def host_bytes(self) -> int:
        return self._buffers.host_bytes(slot for slots in self.slots.values() for slot in slots.values())

    def resident_bytes(self, params: Iterable[torch.Tensor]) -> int:
        """Device bytes of state tensors of ``params`` that are not swapped."""
        total = 0
        for param in params:
            swapped = self.slots.get(param, {})
            for key, value in self._state.get(param, {}).items():
                # Scalars (step counters) are not state memory worth reporting; on the simulator they look resident.
                resident = key not in swapped and isinstance(value, torch.Tensor) and value.dim() > 0
                if resident and self._backend.owns(local_tensor(value)):
                    local = local_tensor(value)
                    total += local.numel() * local.element_size()
        return total


def _same_place(live: SwapSlot, loaded: SwapSlot) -> bool:
    """Whether a loaded state fits the live slot's host mirror exactly (no re-layout needed)."""
    return (
        live.shape == loaded.shape
        and live.dtype == loaded.dtype
        and live.stride == loaded.stride
        and live.layout == loaded.layout
    )


def _is_view_of(local: torch.Tensor, mirror: torch.Tensor) -> bool:
    """Whether ``local`` is ``mirror``'s very memory (same start, shape, strides and dtype)."""
    return (
        local.device == mirror.device
        and local.data_ptr() == mirror.data_ptr()
        and local.shape == mirror.shape
        and local.stride() == mirror.stride()
        and local.dtype == mirror.dtype
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB ({nbytes} bytes)"
