"""One swapped optimizer state tensor and the single place its location changes.

A slot's life::

    pending -> device <-> d2h -> host <-> h2d -> device (-> host: dropped)

``pending``: known, not yet materialized. ``device``: the device copy is
authoritative. ``d2h``: an offload copy is enqueued. ``host``: the host mirror is
authoritative. ``h2d``: a prefetch copy is enqueued. A slot born in host memory
(a fresh zero state) goes ``pending -> host`` directly.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Literal

import torch

from ..backends.dense_storage import is_dense
from ..dtensor import ShardLayout, local_tensor, shard_layout
from ..errors import SwapStateError

__all__ = ["SlotState", "SwapSlot", "is_swappable", "is_swappable_dtype", "memory_stride", "transition"]


class SlotState(enum.Enum):
    PENDING = "pending"
    DEVICE = "device"
    D2H = "d2h"
    HOST = "host"
    H2D = "h2d"


_ALLOWED: dict[SlotState, frozenset[SlotState]] = {
    SlotState.PENDING: frozenset({SlotState.DEVICE, SlotState.HOST}),
    # device -> host: the device copy is dropped unwritten-back; the host mirror never changed (a method run
    # outside step() over the masters that failed, see master_weights/outside_step.py).
    SlotState.DEVICE: frozenset({SlotState.D2H, SlotState.HOST}),
    # d2h -> device: the offload copy could not be enqueued; the device copy stays authoritative.
    SlotState.D2H: frozenset({SlotState.HOST, SlotState.DEVICE}),
    SlotState.HOST: frozenset({SlotState.H2D}),
    # h2d -> host: a prefetched batch was abandoned before its update; the host mirror never changed.
    SlotState.H2D: frozenset({SlotState.DEVICE, SlotState.HOST}),
}


class SwapSlot:
    """A swapped state tensor: its host mirror and, while in flight, its device copy."""

    __slots__ = (
        "device",
        "dtype",
        "host",
        "host_value",
        "key",
        "layout",
        "nbytes",
        "numel",
        "param",
        "shape",
        "spare",
        "state",
        "stride",
    )

    def __init__(
        self,
        param: torch.Tensor,
        key: str,
        shape: torch.Size,
        dtype: torch.dtype,
        layout: ShardLayout | None = None,
        stride: tuple[int, ...] | None = None,
    ) -> None:
        self.param = param
        self.key = key
        self.shape = shape
        self.stride = stride
        """Memory order of the state (``None``: contiguous). Fused kernels read memory in order, so a state
        must keep the layout torch gives it (``zeros_like`` keeps a channels-last or transposed parameter's)."""
        self.dtype = dtype
        self.numel = shape.numel()
        self.nbytes = self.numel * dtype.itemsize
        self.host: torch.Tensor | None = None
        self.spare: torch.Tensor | None = None
        """A second host copy of the same shape, where a walk whose updates are provisional copies the state out
        (the host mirror stays as it was until the step commits: :meth:`StateStore.flip`); ``None`` without one."""
        self.host_value: torch.Tensor | None = None
        """What ``optimizer.state`` holds between steps: the host mirror (a DTensor over it when sharded)."""
        self.device: torch.Tensor | None = None
        self.state = SlotState.PENDING
        self.layout = layout
        """DTensor layout of the state; ``shape`` and all bytes are the local shard's."""

    @classmethod
    def whole(
        cls,
        param: torch.Tensor,
        key: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        stride: tuple[int, ...] | None = None,
    ) -> SwapSlot:
        """A state of ``param`` this rank holds whole: its own ``shape`` (Adafactor's row statistics, a state an
        owner rank keeps for a DTensor parameter), not sharded; ``stride``: a memory order other than contiguous."""
        return cls(param, key, torch.Size(shape), dtype, stride=stride)

    @classmethod
    def sharded_like(
        cls,
        param: torch.Tensor,
        key: str,
        dtype: torch.dtype,
        *,
        like: torch.Tensor | None = None,
        stride: tuple[int, ...] | Literal["like"] | None = "like",
    ) -> SwapSlot:
        """A state of ``param`` shaped, sharded and laid out like ``like`` (``param`` itself by default): the local
        shard's shape, the DTensor layout, and its memory order, as ``zeros_like(p, memory_format=
        torch.preserve_format)`` keeps it (a fused kernel reads a state in memory order, so a channels-last
        parameter's moments are channels-last). ``stride`` replaces that memory order (a loaded tensor's own)."""
        like = param if like is None else like
        local = local_tensor(like)
        order = memory_stride(local) if stride == "like" else stride
        return cls(param, key, local.shape, dtype, shard_layout(like), order)

    def __repr__(self) -> str:
        return f"SwapSlot(key={self.key!r}, shape={tuple(self.shape)}, dtype={self.dtype}, state={self.state.value})"

    def shaped(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (``numel`` elements, e.g. a range of a packed buffer) as this state: its shape and strides."""
        if self.stride is None:
            return flat.view(self.shape)
        return flat.as_strided(self.shape, self.stride)

    @property
    def host_mirror(self) -> torch.Tensor:
        """The host tensor that is authoritative between steps."""
        if self.host is None:
            raise SwapStateError(f"{self!r} has no host mirror yet")
        return self.host


def transition(slots: Iterable[SwapSlot], source: SlotState, target: SlotState) -> None:
    """Move every slot from ``source`` to ``target``; any other starting state is a runtime bug."""
    if target not in _ALLOWED[source]:
        raise SwapStateError(f"Illegal slot transition {source.value} -> {target.value}")
    for slot in slots:
        if slot.state is not source:
            raise SwapStateError(f"{slot!r} expected in state {source.value!r} for -> {target.value}")
        slot.state = target


def is_swappable(tensor: torch.Tensor, *, min_numel: int) -> bool:
    """Whether an existing state tensor can move to host memory between steps.

    Its dtype must be one a host buffer packs (:func:`is_swappable_dtype`), it must be strided and dense
    (its elements fill exactly ``numel`` places in some dimension order: contiguous, channels-last,
    transposed...; host mirrors and staging views keep that order, see :func:`memory_stride`), not a
    0-dim scalar, not a tensor subclass (a DTensor's local shard is checked instead), and large enough
    that moving it pays off. It need not own
    its storage: its values are copied into swap's own host buffer and the entry in ``state`` is
    replaced, so a view into a loaded checkpoint's storage swaps too.
    """
    if type(tensor) not in _PLAIN_TENSOR_TYPES:
        return False  # a tensor subclass (torchao's quantized states): its data is not one strided storage
    if not is_swappable_dtype(tensor.dtype) or tensor.layout is not torch.strided or tensor.dim() == 0:
        return False  # a 0-dim tensor is a scalar (a step counter, which torch may keep on the CPU)
    return is_dense(tensor) and tensor.numel() >= max(min_numel, 1)


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_swappable_dtype(dtype: torch.dtype) -> bool:
    """Any real dtype: floating point moments, and integer or byte states (8-bit optimizers' quantized codes).

    Complex states stay on the device (packing splits buffers by real dtype only).
    """
    return not dtype.is_complex


def memory_stride(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The strides a swapped copy of ``tensor`` keeps: ``None`` when contiguous (or not dense), else its own."""
    if tensor.is_contiguous() or not is_dense(tensor):
        return None
    return tuple(tensor.stride())
