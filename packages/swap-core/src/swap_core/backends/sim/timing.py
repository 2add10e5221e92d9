"""The simulator's virtual clock: how long a step would take on a modeled link and device.

On a CPU host and "device" share one DRAM and one thread, so nothing overlaps and wall-clock time
says nothing about a schedule. With a :class:`LinkModel`, :class:`~swap_core.backends.sim.SimBackend`
gives every stream a virtual timeline instead. Times are assigned when work is *issued*, in issue
order, never when the simulator happens to run it, so they are the same in every simulator mode
and on every machine:

- the host issues each op ``launch_us`` after the previous one; an op starts when the host issued
  it and its stream is free (and every event the stream waits for has passed);
- a copy lasts its bytes over the link's bandwidth in its direction (device to device: twice its
  bytes over device memory bandwidth); copies on two streams overlap, copies on one stream do not;
- a compute op inside ``compute_scope`` lasts the bytes it touches over device memory bandwidth,
  a matrix product its FLOPs over ``device_tflops`` if that is longer;
- an event carries its stream's time when recorded; a stream that waits for it starts no later
  work before then;
- the host has a timeline too: every host-blocking call (an event's or the device's ``synchronize``,
  a value of device memory read by the host such as ``.item()``, a copy from pageable memory)
  advances the host's clock to the time it waited for, so a needless wait in a training loop
  delays the next forward's launch (see :func:`~swap_core.backends.sim.loop.modeled_iterations`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import torch

from swap_core.torch_compat import OpOverload

from .op_modes import ProgramOpMode

__all__ = ["LINK_PRESETS", "LinkModel", "ModeledTimes", "TimedComputeMode", "VirtualClock"]

_GB = 1e9


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """A host link and a device, for the simulator's virtual clock (GB/s are 10^9 bytes per second)."""

    h2d_gbps: float
    """Host-to-device copy bandwidth."""
    d2h_gbps: float
    """Device-to-host copy bandwidth."""
    device_gbps: float
    """Device memory bandwidth: how fast a compute op reads and writes its tensors."""
    launch_us: float = 5.0
    """Host time to issue one op (kernel launch or copy)."""
    device_tflops: float = 100.0
    """Peak matrix-multiply rate (10^12 FLOP/s), for matrix products (Muon's Newton-Schulz)."""

    def __post_init__(self) -> None:
        for field in ("h2d_gbps", "d2h_gbps", "device_gbps", "device_tflops", "launch_us"):
            value: object = getattr(self, field)  # checked at runtime whatever the annotation says
            positive = field != "launch_us"
            number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if not number or value < 0 or (positive and value == 0):  # type: ignore[operator]
                bound = "> 0" if positive else ">= 0"
                raise ValueError(f"LinkModel.{field} must be a finite number {bound}, got {value!r}")

    @classmethod
    def preset(cls, name: str) -> LinkModel:
        """A named link (see :data:`LINK_PRESETS` and docs/simulator.md for the public sources of each number)."""
        try:
            return LINK_PRESETS[name]
        except KeyError:
            raise ValueError(f"Unknown LinkModel preset {name!r}; presets are {sorted(LINK_PRESETS)}") from None

    def copy_seconds(self, direction: str, nbytes: int) -> float:
        """How long a copy of ``nbytes`` lasts in ``direction`` (``"h2d"``, ``"d2h"`` or ``"d2d"``)."""
        if direction == "h2d":
            return nbytes / (self.h2d_gbps * _GB)
        if direction == "d2h":
            return nbytes / (self.d2h_gbps * _GB)
        return 2 * nbytes / (self.device_gbps * _GB)

    def compute_seconds(self, touched_bytes: int, flops: int = 0) -> float:
        """How long a compute op lasts: bytes over memory bandwidth, or FLOPs over the matmul rate if longer."""
        return max(touched_bytes / (self.device_gbps * _GB), flops / (self.device_tflops * 1e12))


LINK_PRESETS: Mapping[str, LinkModel] = {
    # PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b coding = 31.5 GB/s per direction (PCI-SIG); device: NVIDIA A100
    # 40GB PCIe, 1,555 GB/s HBM2, 312 TFLOPS dense bf16 (NVIDIA A100 datasheet).
    "pcie4": LinkModel(h2d_gbps=31.5, d2h_gbps=31.5, device_gbps=1555.0, device_tflops=312.0),
    # PCIe 5.0 x16: 32 GT/s, 63 GB/s per direction (PCI-SIG); device: NVIDIA H100 SXM, 3,350 GB/s HBM3, 989 TFLOPS
    # dense bf16 (NVIDIA H100 datasheet; its 1,979 counts sparsity).
    "pcie5": LinkModel(h2d_gbps=63.0, d2h_gbps=63.0, device_gbps=3350.0, device_tflops=989.0),
    # Ascend 910B: host link PCIe 4.0 x16 (31.5 GB/s); HBM2e whose bandwidth public sources give between 0.4 and
    # 1.6 TB/s (1.2 TB/s taken here); 280 TFLOPS fp16 (Gitee AI's Ascend 910B documentation). Treat as indicative.
    "ascend-910b": LinkModel(h2d_gbps=31.5, d2h_gbps=31.5, device_gbps=1200.0, device_tflops=280.0),
}
"""The named links of :meth:`LinkModel.preset`: theoretical rates, which real pinned copies approach, never reach."""


@dataclasses.dataclass(frozen=True)
class ModeledTimes:
    """Virtual times, in seconds since the backend was made (:meth:`SimBackend.modeled_times`)."""

    host: float
    """When the host issues its next op."""
    compute: float
    """When the compute stream has finished what was issued to it."""
    transfers: float
    """When the copy streams have finished what was issued to them."""
    transfers_started: float | None = None
    """When the first copy issued since the last :meth:`VirtualClock.start_transfer_window` started (``None``: no
    copy since)."""


class VirtualClock:
    """The host's and every stream's virtual time, in seconds since the backend was made."""

    def __init__(self, link: LinkModel) -> None:
        self.link = link
        self.host = 0.0
        """When the host issues its next op."""
        self._free_at: dict[str, float] = {}
        self.transfers_started: float | None = None
        """The start of the first copy since :meth:`start_transfer_window` (``None``: none yet)."""

    def start_transfer_window(self) -> None:
        """Note, from now on, when the first copy issued starts (a step's transfers, measured on the copy streams)."""
        self.transfers_started = None

    def issue_copy(self, stream: str, seconds: float) -> float:
        """A copy of ``seconds`` on ``stream``, issued by the host now; returns when it ends."""
        end = self.issue(stream, seconds)
        start = end - seconds
        if self.transfers_started is None or start < self.transfers_started:
            self.transfers_started = start
        return end

    def free_at(self, stream: str) -> float:
        """When ``stream`` has finished everything issued to it so far."""
        return self._free_at.get(stream, 0.0)

    def issue(self, stream: str, seconds: float) -> float:
        """An op of ``seconds`` on ``stream``, issued by the host now; returns when it ends."""
        start = max(self.host, self.free_at(stream))
        end = start + seconds
        self._free_at[stream] = end
        self.host += self.link.launch_us * 1e-6
        return end

    def wait(self, stream: str, until: float) -> None:
        """``stream`` starts no later work before ``until`` (an event it waits for)."""
        self._free_at[stream] = max(self.free_at(stream), until)

    def host_waits(self, until: float) -> None:
        """The host blocks until ``until`` (it synchronized on an event or the device)."""
        self.host = max(self.host, until)

    def latest(self) -> float:
        """When every stream has finished everything issued to it."""
        return max(self._free_at.values(), default=0.0)


class TimedComputeMode(ProgramOpMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Puts every compute op inside ``compute_scope`` on the virtual timeline of the thread's current stream."""

    def __init__(self, clock: VirtualClock, current_stream: Callable[[], str]) -> None:
        super().__init__()
        self._clock = clock
        self._current_stream = current_stream

    def run_op(self, func: OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> object:
        result = func(*args, **kwargs)
        if func.overloadpacket not in _METADATA_OPS:
            touched = _tensor_bytes([*args, *kwargs.values(), result])
            seconds = self._clock.link.compute_seconds(touched, _matmul_flops(func, args))
            self._clock.issue(self._current_stream(), seconds)
        return result


_METADATA_OPS = {
    torch.ops.aten.view,
    torch.ops.aten._unsafe_view,
    torch.ops.aten.as_strided,
    torch.ops.aten.expand,
    torch.ops.aten.t,
    torch.ops.aten.transpose,
    torch.ops.aten.permute,
    torch.ops.aten.unsqueeze,
    torch.ops.aten.squeeze,
    torch.ops.aten.slice,
    torch.ops.aten.select,
    torch.ops.aten.split,
    torch.ops.aten.split_with_sizes,
    torch.ops.aten.detach,
    torch.ops.aten.alias,
    torch.ops.aten.empty,
    torch.ops.aten.empty_strided,
    torch.ops.aten.empty_like,
    torch.ops.aten.lift_fresh,
    torch.ops.aten._local_scalar_dense,
}
"""Ops that move no data on a device (views, allocation, reading a scalar): they take no modeled time."""

_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


def _tensor_bytes(values: Sequence[object]) -> int:
    """Bytes of the tensors in ``values`` and in the lists and tuples among them (an op's arguments or results)."""
    total = 0
    stack = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, list | tuple):
            stack.extend(value)
    return total


def _matmul_flops(func: OpOverload, args: Sequence[object]) -> int:
    """2·M·N·K of a matrix product (batched: times the batch), 0 for any other op."""
    if func.overloadpacket not in _MATMULS:
        return 0
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
    first, second = tensors[-2], tensors[-1]
    batch = first.shape[0] if first.dim() == 3 else 1
    return 2 * batch * first.shape[-2] * first.shape[-1] * second.shape[-1]
