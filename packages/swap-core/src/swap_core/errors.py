"""Exceptions raised by swap.

Every class also subclasses the builtin a caller would naturally catch, so
``except ValueError`` keeps working for bad arguments and ``except RuntimeError``
for unsupported runtime states.
"""

from __future__ import annotations

import torch

__all__ = [
    "AdapterLoadError",
    "AdapterLoadWarning",
    "AdapterNotFoundError",
    "AdapterVersionError",
    "DeviceMemoryError",
    "DuplicateAdapterError",
    "HostMemoryError",
    "PinnedMemoryWarning",
    "SimError",
    "SimInjectedFault",
    "SimMixedDeviceError",
    "SimOutOfMemoryError",
    "SimPageableCopyError",
    "SimRaceError",
    "SimUseAfterFreeError",
    "StateDictMismatchError",
    "SwapError",
    "SwapStateError",
    "UnsupportedOptimizerError",
]


class SwapError(Exception):
    """Base class of every error raised by swap."""


class AdapterNotFoundError(SwapError, LookupError):
    """No adapter is registered for the optimizer's class or any of its bases."""


class AdapterLoadError(SwapError, ImportError):
    """A plugin of the ``swap_core.adapters`` entry-point group failed to load."""


class AdapterVersionError(AdapterLoadError):
    """A plugin was written for another adapter API version."""


class AdapterLoadWarning(UserWarning):
    """A plugin failed to load; it becomes an error only when its adapter is needed."""


class DuplicateAdapterError(SwapError, ValueError):
    """Two adapters were registered for the same optimizer class or name."""


class UnsupportedOptimizerError(SwapError, ValueError):
    """The optimizer uses an option or layout that swapping cannot support."""


class StateDictMismatchError(SwapError, ValueError):
    """A state dict does not match the optimizer it is loaded into."""


class HostMemoryError(SwapError, MemoryError):
    """The host cannot hold the pinned memory the swapped states need; raised before anything is allocated."""


class DeviceMemoryError(SwapError, MemoryError):
    """The device cannot hold the staging the swapped states need, in any number of batches; raised before any
    batch updates anything, naming the bytes needed, the bytes available and the settings that change them."""


class SwapStateError(SwapError, RuntimeError):
    """The swap runtime was used in a state that does not allow the operation."""


class SimError(SwapError, RuntimeError):
    """The simulated accelerator detected a programming error."""


class SimRaceError(SimError):
    """Two unordered accesses to the same bytes, at least one of them a write."""


class SimUseAfterFreeError(SimError):
    """A compute op touched device storage that was released."""


class SimMixedDeviceError(SimError):
    """A compute op mixed simulated device tensors with host tensors."""


class SimPageableCopyError(SimError):
    """An asynchronous copy was asked of pageable (not pinned) host memory."""


class PinnedMemoryWarning(UserWarning):
    """Pinned host memory could not be allocated; pageable memory makes host copies synchronous."""


class SimOutOfMemoryError(torch.OutOfMemoryError):
    """An allocation beyond ``SimBackend(device_memory=...)``: what a real device's allocator raises (a
    ``torch.OutOfMemoryError``), with the bytes asked, allocated and the capacity."""


class SimInjectedFault(SimError):
    """A fault armed with ``SimBackend.fail_copy`` fired: tests use it to exercise error recovery."""
