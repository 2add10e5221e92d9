"""The device seam: the only interface through which swap touches an accelerator.

Everything that involves streams, events, asynchronous copies, pinned host
allocation or device memory statistics goes through a :class:`DeviceBackend`.
Two implementations exist: :class:`~swap_core.backends.accelerator.AcceleratorBackend`
for real devices (npu, cuda, xpu) and :class:`~swap_core.backends.sim.SimBackend`,
a simulated accelerator over CPU memory that makes ordering bugs fail loudly.

Semantics every backend follows (the CUDA stream model):

* each thread has a *current stream* (``compute_stream()``, changed for a block by
  ``with backend.stream(s):``, as ``torch.cuda.stream`` does); compute ops and
  allocations are issued to it. Work issued on other streams runs asynchronously
  with respect to it and to the host;
* ``copy`` enqueues a copy on a stream and returns immediately;
* ``record_event``/``wait_event`` order streams; ``Event.synchronize`` and
  ``synchronize`` block the host;
* memory returned by ``empty`` and ``restore_storage`` belongs to the stream that
  was current when it was allocated: another stream that writes it must first wait
  for an event recorded on that stream after the allocation;
* ``release_storage`` frees on the stream the memory was allocated on, which may
  reuse it at once: that stream must first wait for every other stream still using
  the memory, or the release names such a stream (``in_use_on``, a caching
  allocator's ``record_stream``). A freed block is handed to an allocation on its
  own stream only, and only once every use recorded for it has completed; the
  allocator never blocks the host to wait for one (it takes new memory instead);
* the host reads and writes host buffers (``empty_host``) only after every copy
  into or out of them that it has issued is complete (``Event.synchronize`` or
  ``synchronize``): a copy still in flight reads or writes them behind its back.
  Host code that touches host buffers runs inside ``host_scope()``, where the
  simulator checks it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from .host_memory import HostMemoryMode

__all__ = ["DeviceBackend", "Event", "ModeledTimes", "Stream"]


@dataclasses.dataclass(frozen=True)
class ModeledTimes:
    """Virtual times, in seconds since the backend was made (:meth:`DeviceBackend.modeled_times`)."""

    host: float
    """When the host issues its next op."""
    compute: float
    """When the compute stream has finished what was issued to it."""
    transfers: float
    """When the copy streams have finished what was issued to them."""
    transfers_started: float | None = None
    """When the first copy issued since the last :meth:`DeviceBackend.start_transfer_window` started (``None``: no
    copy since)."""


class Stream(Protocol):
    """An opaque, backend-specific stream handle."""


@runtime_checkable
class Event(Protocol):
    """A point in a stream's work that other streams or the host can wait for."""

    def query(self) -> bool:
        """Whether all work recorded before the event has completed."""
        ...

    def synchronize(self) -> None:
        """Block the host until the event has completed."""
        ...


@runtime_checkable
class DeviceBackend(Protocol):
    """Streams, events, copies and memory of one accelerator."""

    @property
    def name(self) -> str:
        """Short backend name: ``"sim"``, ``"cuda"``, ``"npu"``, ``"xpu"``."""
        ...

    @property
    def device(self) -> torch.device:
        """The torch device on which this backend's device tensors live."""
        ...

    # -- memory -------------------------------------------------------------
    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in this backend's device memory."""
        ...

    def adopt(self, tensor: torch.Tensor) -> None:
        """Declare an existing tensor (a parameter, a gradient) as device memory.

        Real backends only check the device; the simulator starts tracking it.
        """
        ...

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Allocate device memory on the compute stream; contents are undefined."""
        ...

    def empty_host(self, numel: int, dtype: torch.dtype, *, mode: HostMemoryMode = "exact") -> torch.Tensor:
        """Allocate a 1-D host buffer, pinned as ``mode`` says when possible (see :mod:`.host_memory`;
        a fallback warns once)."""
        ...

    def pinned_bytes(self, buffer: torch.Tensor) -> int:
        """Host bytes pinned for a buffer :meth:`empty_host` returned, rounding included (0 when pageable)."""
        ...

    @property
    def max_host_buffer_bytes(self) -> int:
        """The most bytes one :meth:`empty_host` buffer should take: larger ones may fail to pin (see
        :data:`~swap_core.backends.host_memory.MAX_HOST_BUFFER_BYTES`), so packed host memory comes in chunks."""
        ...

    def empty_host_cache(self) -> None:
        """Give back the pinned blocks the caching host allocator keeps after ``host_memory="caching"`` buffers
        were freed (they stay pinned, and count against the host, until then)."""
        ...

    def available_host_bytes(self) -> int | None:
        """Host bytes that can still be allocated, or ``None`` where it is unknown."""
        ...

    def available_device_bytes(self) -> int | None:
        """Device bytes a new allocation can take now (the device's free memory and the blocks torch's caching
        allocator holds unused), or ``None`` where it is unknown."""
        ...

    def release_storage(self, tensor: torch.Tensor, *, in_use_on: Stream | None = None) -> None:
        """Free the device storage behind ``tensor`` (the tensor object stays valid but empty).

        ``in_use_on``: work already issued to that stream still reads the storage; the bytes are freed
        stream-ordered, handed out again only once that work is done (a caching allocator's
        ``record_stream``), so the compute stream need not wait for it. Otherwise the compute stream must
        have waited for every copy still using the storage.
        """
        ...

    def restore_storage(self, tensor: torch.Tensor) -> None:
        """Re-allocate storage released by :meth:`release_storage`; contents are undefined."""
        ...

    def free_when_done(self, tensor: torch.Tensor, *, allocated_on: Stream, in_use_on: Stream) -> None:
        """The caller drops its last references to ``tensor`` next, memory torch allocated under ``allocated_on``
        (a gradient under FSDP2's post-reduce stream), while work issued to ``in_use_on`` may still read it: its
        block must not go to a new allocation from ``allocated_on``'s pool before that work is done (a caching
        allocator's ``record_stream``). Nothing is needed when the two are one stream (reuse is ordered there)."""
        ...

    def memory_allocated(self) -> int:
        """Device bytes currently allocated."""
        ...

    def max_memory_allocated(self) -> int:
        """Peak device bytes since the last :meth:`reset_peak_memory_stats`."""
        ...

    def memory_reserved(self) -> int:
        """Device bytes the caching allocator holds: allocated plus freed blocks kept for reuse."""
        ...

    def reset_peak_memory_stats(self) -> None:
        """Restart peak tracking from the current allocation."""
        ...

    # -- streams and events --------------------------------------------------
    def compute_stream(self) -> Stream:
        """The calling thread's current stream: where compute ops and allocations are issued."""
        ...

    def stream(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        """Make ``stream`` the calling thread's current stream for the block (``torch.cuda.stream(stream)``)."""
        ...

    def new_stream(self) -> Stream:
        """A new stream for copies."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, stream: Stream) -> None:
        """Enqueue ``dst.copy_(src)`` on ``stream`` (asynchronous when host memory is pinned)."""
        ...

    def record_event(self, stream: Stream, *, timing: bool = False) -> Event:
        """Record an event at the current end of ``stream``'s work (``timing``: usable with :meth:`elapsed_seconds`)."""
        ...

    def elapsed_seconds(self, start: Event, end: Event) -> float:
        """Time between two timing events (blocks until ``end`` completed)."""
        ...

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Make future work on ``stream`` wait until ``event`` has completed."""
        ...

    def synchronize(self) -> None:
        """Block the host until every stream has finished its work."""
        ...

    # -- capabilities ------------------------------------------------------------
    @property
    def host_is_device(self) -> bool:
        """Whether "device" memory is host memory (CPU parameters with master weights): keeping a state resident
        saves nothing there, and every state is swapped."""
        ...

    def modeled_times(self) -> ModeledTimes | None:
        """Where a virtual clock stands now (the simulator with ``timing``), or ``None`` where time is not modeled."""
        ...

    def start_transfer_window(self) -> None:
        """From now on :meth:`modeled_times` notes when the first copy issued starts; nothing without a clock."""
        ...

    def is_capturing(self) -> bool:
        """Whether the current stream is capturing a graph (CUDA graphs): work issued now is recorded, not run."""
        ...

    def compute_scope(self) -> contextlib.AbstractContextManager[None]:
        """Context in which optimizer math runs; the simulator checks every op inside it."""
        ...

    def host_scope(self) -> contextlib.AbstractContextManager[None]:
        """Context in which the host reads or writes host buffers; the simulator checks every op inside it
        against the copies in flight (real backends: nothing)."""
        ...

    def read_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of device ``tensor`` in pageable host memory, as ``tensor.to("cpu")`` makes it: ordered after the
        current stream's work so far, and the host waits for it. Host-blocking: for rare paths only (the journal of
        a first step, see :mod:`swap_core.runtime.step_journal`)."""
        ...
