"""Exact-size pinned host buffers: page-aligned pageable memory, registered with the driver.

torch's pinned allocator rounds every request up to a power of two (a 10 GiB buffer pins 16 GiB).
Registering plain memory of the exact size instead (``cudaHostRegister``) pins what is asked, to
the page. The memory is an anonymous ``mmap`` (page-aligned by construction) that a tensor wraps
with ``torch.frombuffer``: the tensor's storage keeps the mapping alive, every view keeps the
storage alive, and the mapping unregisters itself from the driver when the last of them is gone.

The contract of a registration, stated once:

* A :class:`HostRegistrar` is one runtime's raw pin/unpin calls: ``cudaHostRegister`` through
  ``torch.cuda.cudart()``, ``npuHostRegister`` through torch_npu's ``torch.npu.npurt()``. Other
  devices (xpu) have none (:mod:`~swap_core.backends.device_types` says which has which) and the backend uses the
  caching path.
* A refused registration raises ``RuntimeError`` and leaves the runtime as it was: CUDA records a
  failed call as the thread's *last error*, which the next kernel launch would raise, so the CUDA
  registrar resets it before raising (:func:`~swap_core.torch_compat.clear_cuda_last_error`).
* Runtime calls act on the calling thread's *current* device (and create a context there), but the
  mapping dies on whatever thread drops its last tensor, and under torchrun without ``set_device``
  every rank's current device is 0. :class:`DeviceBoundRegistrar` therefore runs both calls under
  the backend's own device guard.
* Nothing keeps memory torch did not allocate alive for an asynchronous copy still using it (the
  copy kernel records host-allocator events only for torch's own pinned blocks), and the last copy
  out of a buffer is usually still in flight when the optimizer is dropped (``opt.step(); del opt``).
  :class:`DeviceBoundRegistrar` synchronizes the device before it unregisters, so the pages are
  neither unpinned nor unmapped under a copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import warnings
from collections.abc import Callable
from typing import NoReturn, Protocol, SupportsInt

import torch

from ..errors import PinnedMemoryWarning
from ..torch_compat import TorchCompatError, clear_cuda_last_error
from .host_memory import PAGE_BYTES, pinned_size

__all__ = [
    "CudaHostRegistrar",
    "DeviceBoundRegistrar",
    "HostRegistrar",
    "NpuHostRegistrar",
    "RegistrationDevice",
    "registered_host_buffer",
]

_ACL_HOST_REG_PINNED = 0x10000000
"""``aclrtHostRegisterV2``'s flag for page-locking only: the analogue of ``cudaHostRegisterDefault`` and what
torch_npu's own pinned-memory registration uses."""


class HostRegistrar(Protocol):
    """Pins and unpins host memory ranges for one device runtime."""

    def register(self, address: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` at ``address`` for asynchronous copies; raise ``RuntimeError`` on failure."""
        ...

    def unregister(self, address: int) -> None:
        """Undo :meth:`register` for the range starting at ``address``; raise ``RuntimeError`` on failure."""
        ...


class RegistrationDevice(Protocol):
    """The part of ``torch.cuda`` / ``torch.npu`` a :class:`DeviceBoundRegistrar` uses."""

    def device(self, device: int) -> contextlib.AbstractContextManager[object]:
        """The device guard: ``device`` is the thread's current device inside the block."""
        ...

    def synchronize(self, device: torch.device) -> None:
        """Block the host until every stream of ``device`` is idle."""
        ...


class DeviceBoundRegistrar:
    """A runtime's registrar bound to one device: both calls run under that device's guard, whatever the
    calling thread's current device, and :meth:`unregister` first waits for the device's copies.
    """

    def __init__(self, runtime: HostRegistrar, module: RegistrationDevice, device: torch.device) -> None:
        if device.index is None:
            raise ValueError(f"DeviceBoundRegistrar needs a device with an index, got {device}")
        self.runtime = runtime
        self.device = device
        self._index: int = device.index
        self._module = module

    def __repr__(self) -> str:
        return f"DeviceBoundRegistrar({type(self.runtime).__name__}, {str(self.device)!r})"

    def register(self, address: int, nbytes: int) -> None:
        """Page-lock the range in this device's context."""
        with self._module.device(self._index):
            self.runtime.register(address, nbytes)

    def unregister(self, address: int) -> None:
        """Wait until this device is idle, then unpin the range in its context (also when the wait fails:
        a device that cannot synchronize runs nothing more)."""
        with self._module.device(self._index):
            try:
                self._module.synchronize(self.device)
            finally:
                self.runtime.unregister(address)


class _CudaRuntime(Protocol):
    """The part of ``torch.cuda.cudart()`` the CUDA registrar calls; the rest is feature-detected."""

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> SupportsInt: ...

    def cudaHostUnregister(self, address: int) -> SupportsInt: ...


def _torch_cudart() -> _CudaRuntime:
    try:
        return torch.cuda.cudart()  # type: ignore[no-untyped-call,no-any-return]
    except (AssertionError, RuntimeError, AttributeError) as error:  # a torch build without CUDA
        raise RuntimeError(f"the CUDA runtime is not available ({error})") from error


class CudaHostRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's CUDA runtime bindings (loaded when first used).

    ``cudart`` and ``clear_last_error`` stand in for ``torch.cuda.cudart`` and the runtime's
    ``cudaGetLastError`` in tests.
    """

    def __init__(
        self,
        cudart: Callable[[], _CudaRuntime] = _torch_cudart,
        clear_last_error: Callable[[], int] = clear_cuda_last_error,
    ) -> None:
        self._cudart = cudart
        self._clear_last_error = clear_last_error

    def register(self, address: int, nbytes: int) -> None:
        cudart = self._cudart()
        status = int(cudart.cudaHostRegister(address, nbytes, 0))
        if status != 0:
            self._refused(cudart, f"cudaHostRegister({nbytes} bytes) failed with {_cuda_error(cudart, status)}")

    def unregister(self, address: int) -> None:
        cudart = self._cudart()
        status = int(cudart.cudaHostUnregister(address))
        if status != 0:
            self._refused(cudart, f"cudaHostUnregister({address:#x}) failed with {_cuda_error(cudart, status)}")

    def _refused(self, cudart: _CudaRuntime, failure: str) -> NoReturn:
        """Raise ``failure`` once the failed call's status, which stays the thread's last error until read,
        is read: else the next kernel launch raises it. A binding of torch's own is used where it has one;
        where the error cannot be reset, :class:`TorchCompatError` (no fallback can run safely)."""
        get_last_error = getattr(cudart, "cudaGetLastError", None)
        if callable(get_last_error):
            get_last_error()
        else:
            try:
                self._clear_last_error()
            except TorchCompatError as error:
                raise TorchCompatError(f"{failure}; {error}") from error
        raise RuntimeError(failure)


def _cuda_error(cudart: _CudaRuntime, status: int) -> str:
    """``CUDA error 712: <cudaGetErrorString's text>``: torch's ``cudaError`` enum names only ``success``
    (any other value prints as ``cudaError.???``), so the number and the runtime's own text are shown."""
    try:
        text = str(cudart.cudaGetErrorString(cudart.cudaError(status)))  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return f"CUDA error {status}"
    return f"CUDA error {status}: {text}"


class _NpuRuntime(Protocol):
    """The part of torch_npu's ``torch.npu.npurt()`` the NPU registrar calls."""

    def npuHostRegister(self, address: int, nbytes: int, flags: int) -> SupportsInt: ...

    def npuHostUnregister(self, address: int) -> SupportsInt: ...


class NpuHostRegistrar:
    """``npuHostRegister`` / ``npuHostUnregister`` (``aclrtHostRegisterV2``, page-locking only) through
    torch_npu's runtime bindings; torch_npu's ``is_pinned`` recognises memory registered this way."""

    def __init__(self, npurt: Callable[[], _NpuRuntime]) -> None:
        self._npurt = npurt

    def register(self, address: int, nbytes: int) -> None:
        status = int(self._runtime().npuHostRegister(address, nbytes, _ACL_HOST_REG_PINNED))
        if status != 0:
            raise RuntimeError(f"npuHostRegister({nbytes} bytes) failed with ACL error {status}")

    def unregister(self, address: int) -> None:
        status = int(self._runtime().npuHostUnregister(address))
        if status != 0:
            raise RuntimeError(f"npuHostUnregister({address:#x}) failed with ACL error {status}")

    def _runtime(self) -> _NpuRuntime:
        try:
            return self._npurt()
        except (RuntimeError, AttributeError) as error:
            raise RuntimeError(f"torch_npu's runtime bindings are not available ({error})") from error


class _RegisteredMapping(mmap.mmap):
    """An anonymous mapping registered with a device runtime for as long as it exists."""

    address: int
    registrar: HostRegistrar

    def __del__(self) -> None:
        registrar = getattr(self, "registrar", None)
        if registrar is None:
            return
        try:
            registrar.unregister(self.address)
        except Exception as error:  # a finalizer cannot raise, but the user must hear of it
            warnings.warn(
                PinnedMemoryWarning(
                    f"Unregistering exact-size pinned host memory at {self.address:#x} failed ({error}); the "
                    "pages are unmapped now, so a later registration of the same range may be refused "
                    "(host_memory='caching' registers nothing)"
                ),
                stacklevel=1,
            )


def registered_host_buffer(numel: int, dtype: torch.dtype, registrar: HostRegistrar) -> torch.Tensor:
    """A 1-D host tensor of ``numel`` elements over page-aligned memory that ``registrar`` pinned, to the page.

    Raises ``RuntimeError`` (nothing stays allocated or registered) when the runtime refuses.
    """
    nbytes = numel * dtype.itemsize
    size = max(pinned_size(nbytes, "exact"), PAGE_BYTES)
    mapping = _RegisteredMapping(-1, size)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))  # the exporting view is dropped at once
    registrar.register(address, size)
    mapping.address = address
    mapping.registrar = registrar
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(dtype)
