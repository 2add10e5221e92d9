"""The accelerator device types swap-core drives, each one entry: adding a device type is adding a
:class:`DeviceType` to :data:`DEVICE_TYPES` (docs/architecture.md, "Adding a device type").

:class:`~swap_core.backends.accelerator.AcceleratorBackend` drives every entry through ``torch.get_device_module``:
what differs between device types (the extension that registers one with torch, how its runtime pins host memory,
how its copies want their tensors laid out, what a user must install) is data here, not code there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .host_registration import CudaHostRegistrar, HostRegistrar, NpuHostRegistrar

__all__ = ["DEVICE_TYPES", "SUPPORTED_DEVICE_TYPES", "DeviceType", "host_registrar"]


def _no_registrar() -> HostRegistrar | None:
    return None


def _npu_registrar() -> HostRegistrar | None:
    """torch_npu's ``npurt()`` where the loaded torch_npu offers it (looked up, never imported here)."""
    npurt = getattr(getattr(torch, "npu", None), "npurt", None)
    return NpuHostRegistrar(npurt) if callable(npurt) else None


@dataclasses.dataclass(frozen=True)
class DeviceType:
    """What swap-core knows of one accelerator device type."""

    name: str
    """torch's device type (``torch.device(name)``)."""
    unavailable_hint: str
    """What a user needs for it, said when it is not available."""
    extension: str | None = None
    """The out-of-tree module that registers it with torch (imported in case torch's autoload is off)."""
    host_registrar: Callable[[], HostRegistrar | None] = _no_registrar
    """Its runtime's raw pin/unpin calls for exact-size pinned host memory, or ``None`` (the caching path)."""
    no_registrar_hint: str = ""
    """Why it got no registrar, where an upgrade would give it one."""
    flat_copies: bool = False
    """Its host/device copies go direct only for contiguous tensors: same-layout dense pairs are copied as 1-D."""


DEVICE_TYPES: dict[str, DeviceType] = {
    entry.name: entry
    for entry in (
        DeviceType(
            "cuda", "a CUDA build of torch and a visible CUDA device are required", host_registrar=CudaHostRegistrar
        ),
        DeviceType(
            "npu",
            "torch_npu must be installed for the npu device (pip install swap-core[npu]) and an Ascend NPU visible",
            extension="torch_npu",
            host_registrar=_npu_registrar,
            no_registrar_hint=" (this torch_npu offers no torch.npu.npurt(); a newer one does)",
            flat_copies=True,
        ),
        DeviceType("xpu", "an XPU build of torch and a visible Intel GPU are required"),
    )
}
"""Every device type :class:`~swap_core.backends.accelerator.AcceleratorBackend` drives, by name."""

SUPPORTED_DEVICE_TYPES: tuple[str, ...] = tuple(DEVICE_TYPES)
"""Their names (what ``SwapConfig(backend=...)`` accepts beside ``"auto"`` and ``"sim"``)."""


def host_registrar(device_type: str) -> HostRegistrar | None:
    """The registrar of ``device_type``'s runtime, or ``None`` where torch (or its extension) exposes none (an
    unknown device type has none either).

    cuda: always (whether the runtime works shows at the first registration). npu: where the loaded torch_npu
    offers ``torch.npu.npurt()``. xpu: none.
    """
    entry = DEVICE_TYPES.get(device_type)
    return entry.host_registrar() if entry is not None else None
