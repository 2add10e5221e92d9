"""Exact-size pinned host buffers: page-aligned pageable memory, registered with the driver.

torch's pinned allocator rounds every request up to a power of two (a 10 GiB buffer pins 16 GiB).
Registering plain memory of the exact size instead (``cudaHostRegister``) pins what is asked, to
the page. The memory is an anonymous ``mmap`` (page-aligned by construction) that a tensor wraps
with ``torch.frombuffer``: the tensor's storage keeps the mapping alive, every view keeps the
storage alive, and the mapping unregisters itself from the driver when the last of them is gone.

Only CUDA has a public registration API in torch (``torch.cuda.cudart()``); other devices get
``None`` from :func:`host_registrar` and use the caching path.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Protocol

import torch

from .host_memory import pinned_size

__all__ = ["HostRegistrar", "host_registrar", "registered_host_buffer"]


class HostRegistrar(Protocol):
    """Pins and unpins host memory ranges for one device runtime."""

    def register(self, address: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` at ``address`` for asynchronous copies; raise ``RuntimeError`` on failure."""
        ...

    def unregister(self, address: int) -> None:
        """Undo :meth:`register` for the range starting at ``address``."""
        ...


class _CudaHostRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's CUDA runtime bindings (loaded when first used)."""

    def register(self, address: int, nbytes: int) -> None:
        try:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        except (AssertionError, RuntimeError, AttributeError) as error:  # a torch build without CUDA
            raise RuntimeError(f"the CUDA runtime is not available ({error})") from error
        status = cudart.cudaHostRegister(address, nbytes, 0)
        if int(status) != 0:
            raise RuntimeError(f"cudaHostRegister({nbytes} bytes) returned {status}")

    def unregister(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]


def host_registrar(device_type: str) -> HostRegistrar | None:
    """The registrar of ``device_type``'s runtime, or ``None`` where torch exposes none (npu, xpu)."""
    return _CudaHostRegistrar() if device_type == "cuda" else None


class _RegisteredMapping(mmap.mmap):
    """An anonymous mapping registered with a device runtime for as long as it exists."""

    address: int
    registrar: HostRegistrar

    def __del__(self) -> None:
        registrar = getattr(self, "registrar", None)
        if registrar is not None:
            registrar.unregister(self.address)


def registered_host_buffer(numel: int, dtype: torch.dtype, registrar: HostRegistrar) -> torch.Tensor:
    """A 1-D host tensor of ``numel`` elements over page-aligned memory that ``registrar`` pinned, to the page.

    Raises ``RuntimeError`` (nothing stays allocated or registered) when the runtime refuses.
    """
    nbytes = numel * dtype.itemsize
    size = max(pinned_size(nbytes, "exact"), mmap.PAGESIZE)
    mapping = _RegisteredMapping(-1, size)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))  # the exporting view is dropped at once
    registrar.register(address, size)
    mapping.address = address
    mapping.registrar = registrar
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(dtype)
