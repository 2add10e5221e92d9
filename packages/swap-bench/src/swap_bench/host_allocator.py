"""Make the simulator's "device" memory behave like a device allocator's: freed blocks stay in the process.

On the simulator every tensor an update creates (Adam's ``sqrt`` and division
temporaries, 16 MiB each for a 4M-element parameter) is host memory from glibc
``malloc``. glibc gives large freed blocks back to the kernel (``mmap``'d
chunks, heap trimming), so each step page-faults its temporaries in again:
measured on the CI machine, 73k minor faults per *plain* AdamW step on 16 x 4M
fp32 parameters, about half of its 320 ms, and 98k per swapped step. A device
caching allocator (CUDA, NPU) keeps freed blocks, so no step on a real device
pays this; without the setting below the benchmark would mostly measure the
kernel's page-fault path, differently for the plain and the swapped step.

:func:`keep_freed_host_memory` tells glibc (``mallopt``) to serve blocks up to
32 MiB (its largest allowed threshold) from the heap and never to trim it. It
is process-wide and applies to the plain and the swapped optimizer alike;
``swap-bench`` applies it on the simulator unless ``--system-allocator`` is given.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_freed_host_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 * 2**20  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit
_TRIM_THRESHOLD = 2**31 - 1


def keep_freed_host_memory() -> str | None:
    """Keep freed host memory in the process; a description of the setting, or ``None`` where glibc is absent."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None)
    if mallopt is None:
        return None
    if not (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)):
        return None
    return "glibc mallopt M_MMAP_THRESHOLD=32 MiB, M_TRIM_THRESHOLD=2 GiB (freed blocks stay in the process)"
