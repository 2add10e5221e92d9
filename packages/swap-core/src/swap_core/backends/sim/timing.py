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
- a host-device copy (:meth:`VirtualClock.issue_transfer`) shares the link with the copies in the
  other direction that run at the same time: both directions together move at most
  ``duplex_factor`` times one direction's bandwidth, and every copy of the rank together at most
  its share of host memory bandwidth (``host_memory_gbps / ranks_sharing_host``), which also caps a
  copy alone. A copy never changes the times of copies issued before it (they were handed out, and
  events may carry them): it gets what they leave of the link, so while both directions run they
  move ``duplex_factor`` times one direction's bytes, as a fair split would, and the later copy ends
  later than under a fair split (two equal copies issued together: ``3 - duplex_factor`` times one
  copy alone). Two copies in one direction on two streams still overlap unslowed;
- a collective (:meth:`VirtualClock.issue_collective`, an FSDP all-gather's or reduce-scatter's bytes received and
  sent) crosses the same link when ``network_gbps`` says the rank's network card sits behind the device's PCIe
  switch: it shares the link's bandwidth as a copy does, at most ``network_gbps`` each way, and never touches host
  memory (the card reads and writes device memory directly, GPUDirect RDMA);
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

from ..protocol import ModeledTimes
from .op_modes import ProgramOpMode

__all__ = ["LINK_PRESETS", "LinkModel", "ModeledTimes", "TimedComputeMode", "VirtualClock"]

_GB = 1e9

_HOST_LINK_DIRECTIONS = ("h2d", "d2h")
"""Copy directions that cross the host link (a device-to-device copy stays in device memory)."""


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
    duplex_factor: float = 2.0
    """Both directions at once move at most this many times one direction's bandwidth, in [1, 2]: 2.0 is a
    full-duplex link (each direction at its own rate), 1.0 one that moves one direction at a time."""
    host_memory_gbps: float | None = None
    """Host memory bandwidth that the ranks on one host share (a host-to-device copy reads it, a device-to-host
    copy writes it); ``None``: host memory is never the bottleneck. On a host of several sockets, their sum: each
    rank's pinned memory on its own device's socket, the ranks spread evenly, so that a rank's share is also its
    socket's bandwidth over the ranks on that socket."""
    ranks_sharing_host: int = 1
    """Ranks streaming through that host memory at once, each as this one does: this rank's copies together get
    ``host_memory_gbps / ranks_sharing_host``."""
    network_gbps: float | None = None
    """The rank's network card, when it sits behind the device's PCIe switch (one rank a host, each device with its
    own card): the collectives' traffic between ranks crosses the device's link too, at most this rate each way.
    ``None``: the collectives do not use the link (they run over NVLink within a node, or are not modeled)."""

    def __post_init__(self) -> None:
        for field in ("h2d_gbps", "d2h_gbps", "device_gbps", "device_tflops", "launch_us", "duplex_factor"):
            value: object = getattr(self, field)  # checked at runtime whatever the annotation says
            positive = field != "launch_us"
            if not _finite_number(value) or value < 0 or (positive and value == 0):  # type: ignore[operator]
                bound = "> 0" if positive else ">= 0"
                raise ValueError(f"LinkModel.{field} must be a finite number {bound}, got {value!r}")
        if not 1.0 <= self.duplex_factor <= 2.0:
            raise ValueError(f"LinkModel.duplex_factor must be in [1, 2], got {self.duplex_factor!r}")
        host: object = self.host_memory_gbps
        if host is not None and (not _finite_number(host) or host <= 0):  # type: ignore[operator]
            raise ValueError(f"LinkModel.host_memory_gbps must be None or a finite number > 0, got {host!r}")
        network: object = self.network_gbps
        if network is not None and (not _finite_number(network) or network <= 0):  # type: ignore[operator]
            raise ValueError(f"LinkModel.network_gbps must be None or a finite number > 0, got {network!r}")
        ranks: object = self.ranks_sharing_host
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise ValueError(f"LinkModel.ranks_sharing_host must be an int >= 1, got {ranks!r}")

    @classmethod
    def preset(cls, name: str) -> LinkModel:
        """A named link (see :data:`LINK_PRESETS` and docs/simulator.md for the public sources of each number)."""
        try:
            return LINK_PRESETS[name]
        except KeyError:
            raise ValueError(f"Unknown LinkModel preset {name!r}; presets are {sorted(LINK_PRESETS)}") from None

    @property
    def host_share_gbps(self) -> float:
        """The host memory bandwidth this rank's copies get together (infinite without ``host_memory_gbps``)."""
        if self.host_memory_gbps is None:
            return math.inf
        return self.host_memory_gbps / self.ranks_sharing_host

    def link_gbps(self, direction: str) -> float:
        """The link's own bandwidth in ``direction`` (``"h2d"`` or ``"d2h"``), before any host memory share."""
        if direction == "h2d":
            return self.h2d_gbps
        if direction == "d2h":
            return self.d2h_gbps
        raise ValueError(f"Not a host-device copy direction: {direction!r} (expected 'h2d' or 'd2h')")

    def copy_gbps(self, direction: str) -> float:
        """The bandwidth of a host-device copy alone in ``direction``: its link's, or the host share if lower."""
        return min(self.link_gbps(direction), self.host_share_gbps)

    def collective_gbps(self, direction: str) -> float:
        """The bandwidth of a collective's traffic alone in ``direction`` (``"h2d"``: received, ``"d2h"``: sent):
        the link's, or the network card's if lower; 0 when the collectives do not use the link."""
        if self.network_gbps is None:
            return 0.0
        return min(self.link_gbps(direction), self.network_gbps)

    def copy_seconds(self, direction: str, nbytes: int) -> float:
        """How long a copy of ``nbytes`` alone lasts in ``direction`` (``"h2d"``, ``"d2h"`` or ``"d2d"``)."""
        if direction in _HOST_LINK_DIRECTIONS:
            return nbytes / (self.copy_gbps(direction) * _GB)
        return 2 * nbytes / (self.device_gbps * _GB)

    def concurrent_copy_seconds(self, h2d_nbytes: int, d2h_nbytes: int, *, collective_nbytes: int = 0) -> float:
        """The least time in which a host-to-device and a device-to-host copy run at once can both finish, beside
        ``collective_nbytes`` of collective traffic each way (counted only when ``network_gbps`` is set).

        Each direction at most its own bandwidth (shared with the collectives' traffic in it), both together at most
        ``duplex_factor`` times one direction's (in shares of each direction's bandwidth), the copies at most the
        host share, the collectives at most the network card's rate: the bound of a pipeline whose copy-in and
        copy-out overlap. Two directions alone at full duplex: the longer of the two copies.
        """
        network = 0 if self.network_gbps is None else collective_nbytes
        in_link = (h2d_nbytes + network) / (self.h2d_gbps * _GB)
        out_link = (d2h_nbytes + network) / (self.d2h_gbps * _GB)
        return max(
            self.copy_seconds("h2d", h2d_nbytes),
            self.copy_seconds("d2h", d2h_nbytes),
            in_link,
            out_link,
            (in_link + out_link) / self.duplex_factor,
            (h2d_nbytes + d2h_nbytes) / (self.host_share_gbps * _GB),
            network / (self.network_gbps * _GB) if self.network_gbps is not None else 0.0,
        )

    def compute_seconds(self, touched_bytes: int, flops: int = 0) -> float:
        """How long a compute op lasts: bytes over memory bandwidth, or FLOPs over the matmul rate if longer."""
        return max(touched_bytes / (self.device_gbps * _GB), flops / (self.device_tflops * 1e12))


def _finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# H100 on PCIe 5.0: about 55 GB/s each way alone (an nvbandwidth host_to_device_memcpy_ce run at 55.63 GB/s;
# 52.77 GB/s device-to-host with SM copies on an 8x H100 node, NVIDIA/nvbandwidth#24). No public pair of
# bidirectional H100 figures was found: duplex_factor assumed PCIe 4's measured 1.4 (the one PCIe 5 report,
# 51 GB/s host-to-device under device-to-host traffic in #53, gives no figure for the other direction). Host memory
# as for the other achievable presets below.
_PCIE5_ACHIEVABLE = LinkModel(
    h2d_gbps=55.0, d2h_gbps=55.0, device_gbps=3350.0, device_tflops=989.0, duplex_factor=1.4, host_memory_gbps=450.56
)

LINK_PRESETS: Mapping[str, LinkModel] = {
    # Theoretical rates; PCIe is full duplex (each direction has its own lanes): duplex_factor 2.0.
    # PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b coding = 31.5 GB/s per direction (PCI-SIG); device: NVIDIA A100
    # 40GB PCIe, 1,555 GB/s HBM2, 312 TFLOPS dense bf16 (NVIDIA A100 datasheet). Host memory: two sockets of 8 DDR4
    # channels (an 8x A100 node, NVIDIA/nvbandwidth#53) at 3,200 MT/s, 8 bytes a transfer: 409.6 GB/s.
    "pcie4": LinkModel(h2d_gbps=31.5, d2h_gbps=31.5, device_gbps=1555.0, device_tflops=312.0, host_memory_gbps=409.6),
    # PCIe 5.0 x16: 32 GT/s, 63 GB/s per direction (PCI-SIG); device: NVIDIA H100 SXM, 3,350 GB/s HBM3, 989 TFLOPS
    # dense bf16 (NVIDIA H100 datasheet; its 1,979 counts sparsity). Host memory: an 8-GPU Hopper node's two Xeon
    # Platinum 8480C with 32 DIMMs (NVIDIA's MLPerf system description), 8 DDR5 channels each; two DIMMs per channel
    # run at 4,400 MT/s (Dell): 16 x 4,400 MT/s x 8 bytes = 563.2 GB/s.
    "pcie5": LinkModel(h2d_gbps=63.0, d2h_gbps=63.0, device_gbps=3350.0, device_tflops=989.0, host_memory_gbps=563.2),
    # Ascend 910B: host link PCIe 4.0 x16 (31.5 GB/s); HBM2e whose bandwidth public sources give between 0.4 and
    # 1.6 TB/s (1.2 TB/s taken here); 280 TFLOPS fp16 (Gitee AI's Ascend 910B documentation). Treat as indicative.
    # No public figure for its host's memory bandwidth was found: host memory is not modeled.
    "ascend-910b": LinkModel(h2d_gbps=31.5, d2h_gbps=31.5, device_gbps=1200.0, device_tflops=280.0),
    # Achievable rates: pinned copies as measured by nvbandwidth's copy-engine tests; device rates as above. Host
    # memory: assumed 80% of the wire rate (no public STREAM result for these hosts was found).
    # A100 on PCIe 4.0: 25-26 GB/s each way alone; both at once, 12-13 GB/s host-to-device beside 24 GB/s
    # device-to-host (NVIDIA/nvbandwidth#11), 11 beside 25 on an A100-SXM4 node (#53): about 1.4 x one direction.
    "pcie4-achievable": LinkModel(
        h2d_gbps=25.5,
        d2h_gbps=25.5,
        device_gbps=1555.0,
        device_tflops=312.0,
        duplex_factor=1.4,
        host_memory_gbps=327.68,
    ),
    "pcie5-achievable": _PCIE5_ACHIEVABLE,  # see above
    # The same H100 with its network card behind its PCIe switch, as in an 8-GPU Hopper node (one ConnectX-7 a GPU,
    # GPUDirect RDMA through the switch that links the GPU to the host): with one rank a node, FSDP's collectives
    # cross the GPU's PCIe link beside the swap's copies. 400 Gb/s InfiniBand NDR: 50 GB/s each way (wire rate).
    "pcie5-achievable-nic": dataclasses.replace(_PCIE5_ACHIEVABLE, network_gbps=50.0),
    # Ascend 910B: no public pinned-copy measurement was found; assumed the A100's on the same PCIe 4.0 x16.
    "ascend-910b-achievable": LinkModel(
        h2d_gbps=25.5, d2h_gbps=25.5, device_gbps=1200.0, device_tflops=280.0, duplex_factor=1.4
    ),
}
"""The named links of :meth:`LinkModel.preset`: theoretical rates (``pcie4``, ``pcie5``, ``ascend-910b``), which real
pinned copies approach, never reach, and ``-achievable`` ones, as measured (docs/simulator.md gives the sources).
A preset describes one rank alone on its host: ``dataclasses.replace(link, ranks_sharing_host=8)`` shares the host's
memory with 8 ranks."""


class VirtualClock:
    """The host's and every stream's virtual time, in seconds since the backend was made."""

    def __init__(self, link: LinkModel) -> None:
        self.link = link
        self.host = 0.0
        """When the host issues its next op."""
        self._free_at: dict[str, float] = {}
        self._host_link = _HostLinkUsage(link)
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

    def issue_transfer(self, stream: str, direction: str, nbytes: int) -> float:
        """A copy of ``nbytes`` in ``direction`` on ``stream``, issued by the host now; returns when it ends.

        A host-device copy shares the link with the copies in the other direction issued before it (the duplex
        factor and the host memory share, see the module's docstring); a device-to-device copy is
        :meth:`issue_copy` of its :meth:`LinkModel.copy_seconds`.
        """
        seconds = self.link.copy_seconds(direction, nbytes)
        if direction not in _HOST_LINK_DIRECTIONS:
            return self.issue_copy(stream, seconds)
        start = max(self.host, self.free_at(stream))
        end = self._on_link(stream, direction, start, nbytes, through_host=True)
        if self.transfers_started is None or start < self.transfers_started:
            self.transfers_started = start
        return end

    def issue_collective(self, stream: str, direction: str, nbytes: int) -> float:
        """A collective's ``nbytes`` received (``"h2d"``) or sent (``"d2h"``) on ``stream``, issued by the host now;
        returns when they have crossed. On the link beside the copies when ``LinkModel.network_gbps`` is set (see
        the module's docstring); otherwise the collectives are not modeled: nothing is issued, and it returns now."""
        if self.link.network_gbps is None:
            return self.host
        start = max(self.host, self.free_at(stream))
        return self._on_link(stream, direction, start, nbytes, through_host=False)

    def _on_link(self, stream: str, direction: str, start: float, nbytes: int, *, through_host: bool) -> float:
        self._host_link.forget_before(self.host)  # nothing issued from now on starts earlier
        end = self._host_link.occupy(direction, start, nbytes, through_host=through_host)
        self._free_at[stream] = end
        self.host += self.link.launch_us * 1e-6
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


class _HostLinkUsage:
    """The bandwidth that the traffic issued so far takes on the host link, direction by direction, over virtual time.

    Each copy or collective is kept as spans of constant bandwidth (bytes/s) until nothing issued later can start
    before they end. A new one gets, at every instant, what the others leave: at most its bandwidth alone, at most
    its direction's link bandwidth minus what the traffic of the other kind (collectives for a copy, copies for a
    collective) takes in that direction, at most ``duplex_factor - u`` times its direction's link bandwidth (``u``:
    the shares of their own direction's link bandwidth that those and all the traffic in the other direction use),
    and, a copy through host memory, at most the host share minus what the other such copies take. Two copies in one
    direction on two streams overlap unslowed by each other (the swap's only such pair is a small read beside a
    copy-out, which the link interleaves; handed-out times cannot be shared fairly after the fact).
    """

    def __init__(self, link: LinkModel) -> None:
        self._link = link
        self._spans: dict[str, list[_Span]] = {direction: [] for direction in _HOST_LINK_DIRECTIONS}

    def forget_before(self, time: float) -> None:
        """Drop the spans that end by ``time``."""
        for direction, spans in self._spans.items():
            self._spans[direction] = [span for span in spans if span.end > time]

    def occupy(self, direction: str, start: float, nbytes: int, *, through_host: bool) -> float:
        """Place ``nbytes`` in ``direction`` from ``start`` (a copy through host memory, or a collective's traffic
        that does not touch it); returns when they have crossed."""
        link = self._link
        alone = (link.copy_gbps(direction) if through_host else link.collective_gbps(direction)) * _GB
        others = [span for spans in self._spans.values() for span in spans]
        bounds = sorted({time for span in others for time in (span.begin, span.end) if time > start})
        placed: list[_Span] = []
        slowed = False
        now, remaining = start, float(nbytes)
        for until in [*bounds, math.inf]:  # the others' bandwidth is constant in between
            rate = self._rate_left(direction, now, alone, through_host=through_host)
            slowed = slowed or rate < alone
            if rate > 0:  # else it waits for the link
                finish = now + remaining / rate
                if finish <= until:
                    placed.append(_Span(now, finish, rate, through_host))
                    break
                placed.append(_Span(now, until, rate, through_host))
                remaining -= (until - now) * rate
            now = until
        if not slowed:  # exactly alone, as without sharing
            placed = [_Span(start, start + nbytes / alone, alone, through_host)]
        self._spans[direction].extend(placed)
        return placed[-1].end

    def _rate_left(self, direction: str, now: float, alone: float, *, through_host: bool) -> float:
        link = self._link
        used = {key: 0.0 for key in _HOST_LINK_DIRECTIONS}
        host_used = 0.0
        for key, spans in self._spans.items():
            for span in spans:
                if span.begin <= now < span.end:
                    if key != direction or span.through_host != through_host:
                        used[key] += span.rate
                    host_used += span.rate if span.through_host else 0.0
        own_link = link.link_gbps(direction) * _GB
        duplex_left = link.duplex_factor - sum(used[key] / (link.link_gbps(key) * _GB) for key in used)
        rate = min(alone, own_link - used[direction], own_link * duplex_left)
        if through_host:
            rate = min(rate, link.host_share_gbps * _GB - host_used)
        return max(0.0, rate)


@dataclasses.dataclass(frozen=True)
class _Span:
    """Traffic at a constant ``rate`` (bytes/s) from ``begin`` to ``end``, through host memory or not."""

    begin: float
    end: float
    rate: float
    through_host: bool


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
