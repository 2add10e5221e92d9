"""DTensors over host mirrors that DCP's staging (``dcp.async_save``) can copy, in torch 2.13.

A swapped state's host mirror is a range of a packed host buffer, so its local tensor starts at a
nonzero storage offset. Since pytorch/pytorch#167597 a DTensor carries its local tensor's storage
offset, so the DTensor's own ``data_ptr()`` is nonzero, and ``StateDictStager._offload_tensor`` (the
copy behind ``DefaultStager``) then takes it for a plain tensor and copies its storage, which a
DTensor does not have: ``RuntimeError: Attempted to call copy_() on an invalid python storage``. A
DTensor whose local tensor starts at offset 0 takes the stager's DTensor path.

:func:`offset_free` gives such a DTensor over the same bytes: its local tensor is an alias that
begins its own storage (``torch.frombuffer`` over the bytes, which keeps the buffer alive). No byte
is copied; reads and writes through it are reads and writes of the mirror.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from swap_core.backends import is_dense

__all__ = ["offset_free"]


def offset_free(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or for a CPU DTensor whose local tensor starts inside its storage, one over an alias."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    local = tensor.to_local()
    if local.device.type != "cpu" or local.storage_offset() == 0 or local.numel() == 0 or not is_dense(local):
        return tensor
    alias = _alias(local)
    return DTensor.from_local(
        alias, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


def _alias(local: torch.Tensor) -> torch.Tensor:
    """A tensor over ``local``'s bytes at storage offset 0 of a storage of its own (dense ``local`` only)."""
    nbytes = local.numel() * local.element_size()
    raw: Any = (ctypes.c_char * nbytes).from_address(local.data_ptr())
    raw.keepalive = local  # the buffer lives as long as the alias (frombuffer keeps `raw`)
    flat = torch.frombuffer(raw, dtype=local.dtype)
    return flat.as_strided(local.shape, local.stride())
