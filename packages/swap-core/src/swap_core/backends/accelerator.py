"""The real-device backend: npu, cuda and xpu through ``torch.get_device_module``.

Every accelerator torch knows exposes the same module surface (``Stream``,
``Event``, ``current_stream``, ``stream``, ``synchronize``, memory statistics),
so one class serves them all and library code never names ``torch.cuda`` or
``torch.npu``. The backend is deliberately thin: ordering is the caller's job,
expressed through events, exactly as the :mod:`~swap_core.backends.protocol`
describes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import weakref
from collections.abc import Sequence
from typing import Protocol, cast

import torch

from swap_core.backends.dense_storage import is_dense, spans_whole_storage
from swap_core.backends.device_types import DEVICE_TYPES, SUPPORTED_DEVICE_TYPES
from swap_core.backends.host_memory import (
    MAX_HOST_BUFFER_BYTES,
    HostMemoryMode,
    available_host_bytes,
    pinned_size,
    warn_pinning_once,
)
from swap_core.backends.host_registration import DeviceBoundRegistrar, HostRegistrar, registered_host_buffer
from swap_core.backends.protocol import Event, ModeledTimes, Stream
from swap_core.torch_compat import TorchCompatError, host_empty_cache

__all__ = ["SUPPORTED_DEVICE_TYPES", "AcceleratorBackend", "DeviceModule", "accelerator_available", "empty_pinned"]

_PINNED_BYTES = "_swap_pinned_bytes"
"""Attribute an ``empty_host`` buffer carries: the host bytes pinned for it."""


class _DeviceStream(Protocol):
    def wait_event(self, event: _DeviceEvent) -> None: ...


class _DeviceEvent(Protocol):
    def record(self, stream: _DeviceStream | None = None) -> None: ...
    def elapsed_time(self, end_event: _DeviceEvent) -> float: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DeviceModule(Protocol):
    """The part of ``torch.cuda`` / ``torch.npu`` / ``torch.xpu`` this backend uses."""

    def is_available(self) -> bool: ...

    def device_count(self) -> int: ...

    def current_device(self) -> int: ...

    def device(self, device: int) -> contextlib.AbstractContextManager[object]: ...

    def Stream(self, device: torch.device) -> _DeviceStream: ...

    def Event(self, enable_timing: bool = False) -> _DeviceEvent: ...

    def current_stream(self, device: torch.device) -> _DeviceStream: ...

    def stream(self, stream: _DeviceStream) -> contextlib.AbstractContextManager[object]: ...

    def synchronize(self, device: torch.device) -> None: ...

    def memory_allocated(self, device: torch.device) -> int: ...

    def max_memory_allocated(self, device: torch.device) -> int: ...

    def memory_reserved(self, device: torch.device) -> int: ...

    def mem_get_info(self, device: torch.device) -> tuple[int, int]: ...

    def reset_peak_memory_stats(self, device: torch.device) -> None: ...


class AcceleratorBackend:
    """Streams, events, copies and memory of one real accelerator device.

    ``device_index=None`` means the device current at construction.
    """

    def __init__(self, device_type: str, device_index: int | None = None) -> None:
        self._setup(device_type, _load_device_module(device_type), device_index, None)

    @classmethod
    def from_device_module(
        cls,
        device_type: str,
        module: DeviceModule,
        device_index: int | None = None,
        registrar: HostRegistrar | None = None,
    ) -> AcceleratorBackend:
        """A backend over an explicit device module: ``torch.cuda``, ``torch_npu.npu``, or any object with the
        members of :class:`DeviceModule` (a test's fake device, an out-of-tree accelerator's module), and
        optionally the runtime's host registrar (which the backend binds to its device). The module is taken as
        it is: the availability check of ``AcceleratorBackend(device_type)`` is skipped."""
        backend = cls.__new__(cls)
        backend._setup(device_type, module, device_index, registrar)
        return backend

    def _setup(
        self, device_type: str, module: DeviceModule, device_index: int | None, registrar: HostRegistrar | None
    ) -> None:
        index = module.current_device() if device_index is None else device_index
        count = module.device_count()
        if type(index) is not int or not 0 <= index < count:  # bool is an int subclass: rejected too
            raise ValueError(f"Invalid {device_type} device index {device_index!r}: {count} device(s) are visible")
        self._module = module
        self._device = torch.device(device_type, index)
        self._warned: set[str] = set()
        kind = DEVICE_TYPES[device_type]
        runtime = kind.host_registrar() if registrar is None else registrar
        self._registrar = None if runtime is None else DeviceBoundRegistrar(runtime, module, self._device)
        self._pinned_storages: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()
        self._flat_copies = kind.flat_copies

    def __repr__(self) -> str:
        return f"AcceleratorBackend({str(self._device)!r})"

    @property
    def name(self) -> str:
        """The device type: ``"cuda"``, ``"npu"`` or ``"xpu"``."""
        return self._device.type

    @property
    def device(self) -> torch.device:
        """The device (with its index) this backend allocates on."""
        return self._device

    # -- memory -------------------------------------------------------------
    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on exactly this backend's device."""
        return tensor.device == self._device

    def adopt(self, tensor: torch.Tensor) -> None:
        """Real memory needs no tracking; only check that the tensor is on this device."""
        if not self.owns(tensor):
            raise ValueError(f"Expected a tensor on {self._device}, got one on {tensor.device}")

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialized device memory from torch's caching allocator, on the current stream."""
        return torch.empty(tuple(shape), dtype=dtype, device=self._device)

    def empty_host(self, numel: int, dtype: torch.dtype, *, mode: HostMemoryMode = "exact") -> torch.Tensor:
        """A pinned host buffer, pinned as :mod:`~swap_core.backends.host_memory` describes.

        ``"exact"``: page-aligned memory registered with the driver (CUDA, NPU) on this backend's device,
        unregistered when the last tensor using it is gone; where that fails or the device has no public
        way to do it, the caching path (one warning). ``"caching"``: torch's pinned allocator. Pageable
        when pinning fails altogether, which makes copies synchronous but still correct. A failed
        registration whose runtime error cannot be reset raises :class:`~swap_core.torch_compat.TorchCompatError`
        instead of falling back: the next kernel launch would raise that error.
        """
        nbytes = numel * dtype.itemsize
        if mode == "exact":
            if self._registrar is not None:
                try:
                    buffer = registered_host_buffer(numel, dtype, self._registrar)
                except TorchCompatError:
                    raise
                except RuntimeError as error:
                    self._warn_caching_once(f"registering it with the driver failed ({error})")
                else:
                    return self._record_pinned(buffer, pinned_size(nbytes, "exact"))
            else:
                hint = DEVICE_TYPES[self.name].no_registrar_hint
                self._warn_caching_once(f"{self.name} has no public way to register host memory{hint}")
        try:
            buffer = empty_pinned(numel, dtype)
        except RuntimeError as error:
            self._warn_pageable_once(error)
            return torch.empty(numel, dtype=dtype)
        return self._record_pinned(buffer, pinned_size(nbytes, "caching"))

    def pinned_bytes(self, buffer: torch.Tensor) -> int:
        """Host bytes pinned for ``buffer`` (from :meth:`empty_host`), rounding included; 0 when pageable."""
        return int(getattr(buffer, _PINNED_BYTES, 0))

    @property
    def max_host_buffer_bytes(self) -> int:
        """:data:`~swap_core.backends.host_memory.MAX_HOST_BUFFER_BYTES`: packed host memory pins in chunks."""
        return MAX_HOST_BUFFER_BYTES

    def empty_host_cache(self) -> None:
        """The caching host allocator's ``empty_cache`` (``torch._C._host_emptyCache``, torch_npu's
        ``host_empty_cache``); nothing where the device has none."""
        host_empty_cache(self.name)

    def available_host_bytes(self) -> int | None:
        """This host's available memory (``MemAvailable`` on Linux)."""
        return available_host_bytes()

    def available_device_bytes(self) -> int | None:
        """The device's free memory (``mem_get_info``) and what torch's caching allocator holds unused; ``None``
        where the device module cannot tell."""
        mem_get_info = getattr(self._module, "mem_get_info", None)
        if mem_get_info is None:
            return None
        free, _ = mem_get_info(self._device)
        cached = self._module.memory_reserved(self._device) - self._module.memory_allocated(self._device)
        return int(free) + max(int(cached), 0)

    def _record_pinned(self, buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
        """Note what ``buffer`` pins, and that its storage is pinned (for :meth:`copy`, without asking the driver)."""
        setattr(buffer, _PINNED_BYTES, nbytes)
        self._pinned_storages.add(buffer.untyped_storage())
        return buffer

    def _warn_caching_once(self, reason: str) -> None:
        warn_pinning_once(
            self._warned,
            "caching",
            f"Exact-size pinned host memory is not available on {self._device}: {reason}. Host buffers come "
            "from torch's caching pinned allocator, which rounds each one up to a power of two "
            "(opt.stats.host_pinned_bytes shows what is pinned; host_memory='caching' skips the attempt)",
            stacklevel=3,
        )

    def _warn_pageable_once(self, error: RuntimeError) -> None:
        warn_pinning_once(
            self._warned,
            "pageable",
            f"Pinned host memory could not be allocated for {self._device} ({error}); "
            "falling back to pageable memory. Host<->device copies become synchronous, so transfers no "
            "longer overlap with compute. Check the accelerator runtime or raise the memlock limit (ulimit -l).",
            stacklevel=3,
        )

    def release_storage(self, tensor: torch.Tensor, *, in_use_on: Stream | None = None) -> None:
        """Hand the bytes back to the caching allocator; the tensor keeps its shape with an empty storage.

        ``in_use_on``: ``tensor.record_stream(stream)`` first, so the allocator reuses the block only once
        the work already issued to that stream is done (not yet run on hardware).
        """
        if in_use_on is not None:
            tensor.record_stream(in_use_on)  # type: ignore[arg-type]
        tensor.untyped_storage().resize_(0)

    def free_when_done(self, tensor: torch.Tensor, *, allocated_on: Stream, in_use_on: Stream) -> None:
        """``tensor.record_stream(in_use_on)`` when it is another stream than ``allocated_on`` (not yet run on
        hardware)."""
        if in_use_on != allocated_on:
            tensor.record_stream(in_use_on)  # type: ignore[arg-type]

    def restore_storage(self, tensor: torch.Tensor) -> None:
        """Regrow a released storage; only whole-storage tensors can be regrown to a known size."""
        if not spans_whole_storage(tensor):
            raise ValueError(
                "restore_storage needs a dense tensor at storage offset 0, got shape "
                f"{tuple(tensor.shape)}, stride {tensor.stride()}, offset {tensor.storage_offset()}"
            )
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())

    def memory_allocated(self) -> int:
        """Bytes held by tensors on this device (torch's caching-allocator statistic)."""
        return self._module.memory_allocated(self._device)

    def max_memory_allocated(self) -> int:
        """Peak of :meth:`memory_allocated` since the last reset."""
        return self._module.max_memory_allocated(self._device)

    def memory_reserved(self) -> int:
        """Bytes torch's caching allocator holds on this device, cached free blocks included."""
        return self._module.memory_reserved(self._device)

    def reset_peak_memory_stats(self) -> None:
        """Restart peak tracking from the current allocation."""
        self._module.reset_peak_memory_stats(self._device)

    # -- streams and events --------------------------------------------------
    def compute_stream(self) -> Stream:
        """The calling thread's current stream on this device, on which optimizer math is issued."""
        return self._module.current_stream(self._device)

    def stream(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        """``torch.<device>.stream(stream)``: ``stream`` is the current stream for the block."""
        return cast("contextlib.AbstractContextManager[None]", self._module.stream(_device_stream(stream)))

    def new_stream(self) -> Stream:
        """A fresh stream on this device for copies."""
        return self._module.Stream(device=self._device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, stream: Stream) -> None:
        """Enqueue the copy on ``stream``; asynchronous only when the host side is pinned (else torch syncs).

        One call per state tensor and step, so its host cost counts: the storages :meth:`empty_host`
        pinned are known pinned without ``is_pinned()`` (a driver query on CUDA; other host tensors are
        still asked), and ``stream`` is entered only when it is not already current. Two dense tensors
        of one non-contiguous layout (channels-last, transposed) are copied as the flat ranges they
        occupy, which holds the same elements in the same places, on NPU: torch_npu copies between host and
        device directly only for contiguous tensors (else through a pageable temporary and a stream sync);
        CUDA copies such pairs directly already, and flattening would only add host time (about 2 us).
        """
        non_blocking = self._may_copy_async(dst) and self._may_copy_async(src)
        if self._flat_copies:
            dst, src = _flat_if_same_dense_strides(dst, src)
        if self._module.current_stream(self._device) == stream:
            dst.copy_(src, non_blocking=non_blocking)
            return
        with self._module.stream(_device_stream(stream)):
            dst.copy_(src, non_blocking=non_blocking)

    def _may_copy_async(self, tensor: torch.Tensor) -> bool:
        """Asynchrony needs pinned host memory; a pageable host side stays a blocking (always correct) copy."""
        return not tensor.is_cpu or tensor.untyped_storage() in self._pinned_storages or tensor.is_pinned()

    def record_event(self, stream: Stream, *, timing: bool = False) -> Event:
        """A new event recorded at the current end of ``stream``."""
        event = self._module.Event(enable_timing=timing)
        event.record(_device_stream(stream))
        return event

    def elapsed_seconds(self, start: Event, end: Event) -> float:
        """Device time between two timing events."""
        end.synchronize()
        return cast(_DeviceEvent, start).elapsed_time(cast(_DeviceEvent, end)) / 1000.0

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Device-side wait: the host does not block."""
        _device_stream(stream).wait_event(cast(_DeviceEvent, event))

    def synchronize(self) -> None:
        """Block the host until every stream of this device is idle."""
        self._module.synchronize(self._device)

    @property
    def host_is_device(self) -> bool:
        """Device memory is the accelerator's own."""
        return False

    def modeled_times(self) -> ModeledTimes | None:
        """A real device's time is not modeled: ``None``."""
        return None

    def start_transfer_window(self) -> None:
        """Nothing to note: a real device has no virtual clock."""

    def is_capturing(self) -> bool:
        """``torch.<device>.is_current_stream_capturing()`` where the device module has it (CUDA graphs)."""
        capturing = getattr(self._module, "is_current_stream_capturing", None)
        return bool(capturing()) if callable(capturing) else False

    def compute_scope(self) -> contextlib.AbstractContextManager[None]:
        """Real devices need no per-op checking."""
        return contextlib.nullcontext()

    def host_scope(self) -> contextlib.AbstractContextManager[None]:
        """Real devices need no per-op checking."""
        return contextlib.nullcontext()

    def read_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor.to("cpu")``: a copy on the current stream into pageable memory, which the host waits for."""
        return tensor.detach().to("cpu", copy=True)


def accelerator_available(device_type: str) -> bool:
    """Whether :class:`AcceleratorBackend` can drive a ``device_type`` device here (never raises)."""
    try:
        _load_device_module(device_type)
    except (RuntimeError, ValueError):
        return False
    return True


def _load_device_module(device_type: str) -> DeviceModule:
    kind = DEVICE_TYPES.get(device_type)
    if kind is None:
        raise ValueError(
            f"Unsupported accelerator device type {device_type!r}; AcceleratorBackend supports "
            f"{', '.join(SUPPORTED_DEVICE_TYPES)} (use backend='sim' for the simulated accelerator)"
        )
    unavailable = (
        f"The {device_type} accelerator is not available to torch {torch.__version__}: "
        f"{kind.unavailable_hint} (or use backend='sim' for the simulated accelerator)"
    )
    try:
        extension = kind.extension
        if extension is not None:  # normally autoloaded by torch; imported here in case autoload is off
            importlib.import_module(extension)
        module = torch.get_device_module(device_type)
    except (ImportError, RuntimeError, AttributeError) as error:  # torch does not know the device type
        raise RuntimeError(unavailable) from error
    if not module.is_available():
        raise RuntimeError(unavailable)
    return cast(DeviceModule, module)


def empty_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """torch's pinned allocation; a function of its own, so that tests can make pinning fail where it works."""
    return torch.empty(numel, dtype=dtype, pin_memory=True)


def _flat_if_same_dense_strides(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` and ``src`` as 1-D views over the elements they occupy, when both are dense with one shape
    and one stride but not contiguous; else as they are.

    Dense tensors of equal strides place every element at the same offset from their first one, so the
    flat copy writes exactly what the strided one would, and only those bytes.
    """
    if dst.is_contiguous() and src.is_contiguous():
        return dst, src
    shape, stride = dst.shape, dst.stride()
    if shape != src.shape or stride != src.stride() or not _dense_strides(shape, stride):
        return dst, src
    flat = (dst.numel(),)
    return dst.as_strided(flat, (1,)), src.as_strided(flat, (1,))  # each keeps its own storage offset


@functools.lru_cache(maxsize=1024)
def _dense_strides(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Whether ``shape`` and ``stride`` densely fill ``numel`` places (a few layouts per model: cached, as
    :func:`~swap_core.backends.dense_storage.is_dense` costs more than the copy it decides)."""
    return shape.numel() > 0 and is_dense(torch.empty_strided(shape, stride, device="meta"))


def _device_stream(stream: Stream) -> _DeviceStream:
    """Streams handed to this backend are the ones it created, so they carry the module's stream API."""
    return cast(_DeviceStream, stream)
