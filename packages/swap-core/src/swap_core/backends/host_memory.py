"""Pinned host memory: how much a buffer really pins, and how much the host has left.

The contract, stated once (every backend's ``empty_host`` follows it):

* ``host_memory="exact"``: a buffer pins its size rounded up to the host's page (:data:`PAGE_BYTES`:
  4 KiB on x86-64, 64 KiB on many aarch64 hosts such as GH200), and nothing else. On CUDA and NPU the
  backend allocates page-aligned pageable memory and registers it with the driver
  (``cudaHostRegister``, ``npuHostRegister``), unregistering it when the last tensor using it is gone.
  Where that is not possible it falls back to the caching path, warning once.
* ``host_memory="caching"``: torch's pinned allocator (``CachingHostAllocator``), which rounds every
  request up to the next power of two: a 10 MiB + 4 B buffer pins 16 MiB.
* When pinning fails altogether, the buffer is pageable (pins nothing; copies become synchronous),
  warning once.
* No buffer the swap asks for is larger than :data:`MAX_HOST_BUFFER_BYTES` (a backend's
  ``max_host_buffer_bytes``) when it can be helped: some drivers refuse to register more than about 8-12 GiB at
  once, so packed host memory is cut into chunks of at most that size (only a single state larger than it gets a
  buffer of its own size).

``pinned_size`` models both roundings, so the simulator and the accounting agree exactly with what a
real device pins; ``available_host_bytes`` is what the host can still give before swapping allocates.
"""

from __future__ import annotations

import mmap
import os
import warnings
from typing import Literal

from ..errors import PinnedMemoryWarning

__all__ = [
    "HOST_MEMORY_MODES",
    "MAX_HOST_BUFFER_BYTES",
    "PAGE_BYTES",
    "HostMemoryMode",
    "available_host_bytes",
    "pinned_size",
    "warn_pinning_once",
]

HostMemoryMode = Literal["exact", "caching"]

HOST_MEMORY_MODES: tuple[HostMemoryMode, ...] = ("exact", "caching")
"""Values of ``SwapConfig.host_memory``."""

PAGE_BYTES: int = mmap.PAGESIZE
"""The unit exact pinning rounds to: this host's page (registration pins whole pages), read once at import."""

MAX_HOST_BUFFER_BYTES = 4 << 30
"""The most bytes one host buffer of the swap takes, by default (4 GiB): below the sizes some drivers refuse to
register at once (reported from about 8 GiB), and large enough that cutting a copy at a chunk's end costs nothing."""

_MEMINFO = "/proc/meminfo"


def pinned_size(nbytes: int, mode: HostMemoryMode) -> int:
    """Bytes a pinned buffer of ``nbytes`` holds: rounded to the page (exact) or to a power of two (caching)."""
    if nbytes <= 0:
        return 0
    if mode == "exact":
        return -(-nbytes // PAGE_BYTES) * PAGE_BYTES
    return 1 << (nbytes - 1).bit_length()


def available_host_bytes() -> int | None:
    """Host memory that can still be allocated without swapping to disk, or ``None`` where it is unknown.

    Linux: ``MemAvailable`` of ``/proc/meminfo`` (free memory plus reclaimable caches); elsewhere the
    free physical pages (``os.sysconf``), when the platform reports them.
    """
    try:
        with open(_MEMINFO, encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def warn_pinning_once(warned: set[str], kind: str, message: str, *, stacklevel: int) -> None:
    """A :class:`~swap_core.errors.PinnedMemoryWarning` the first time a backend falls back ``kind``-wise.

    ``warned`` is the backend's own set (each backend instance warns for itself); ``stacklevel`` counts
    from the function calling this (1), as ``warnings.warn``'s does.
    """
    if kind in warned:
        return
    warned.add(kind)
    warnings.warn(PinnedMemoryWarning(message), stacklevel=stacklevel + 1)
