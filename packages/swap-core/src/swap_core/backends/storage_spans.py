"""Sets of storages by the bytes they cover: "does this tensor live in one of those buffers?".

Storage identity cannot answer it once one buffer is reached through several storages (an alias
made with ``torch.frombuffer`` over a range of it); addresses can. Each storage added covers
``[data_ptr, data_ptr + nbytes)`` on its device; a tensor is inside when its first byte is.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import torch

__all__ = ["StorageSpans"]


class StorageSpans:
    """The byte ranges of some tensors' whole storages, per device (overlapping ranges merged)."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        spans: dict[torch.device, list[tuple[int, int]]] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes():
                start = storage.data_ptr()
                spans.setdefault(tensor.device, []).append((start, start + storage.nbytes()))
        self._starts: dict[torch.device, list[int]] = {}
        self._ends: dict[torch.device, list[int]] = {}
        for device, device_spans in spans.items():
            merged: list[tuple[int, int]] = []
            for start, end in sorted(device_spans):
                if merged and start <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], end))
                else:
                    merged.append((start, end))
            self._starts[device] = [start for start, _ in merged]
            self._ends[device] = [end for _, end in merged]

    def __contains__(self, tensor: object) -> bool:
        """Whether ``tensor``'s first byte lies in one of the storages (never for an empty tensor)."""
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            return False
        starts = self._starts.get(tensor.device)
        if starts is None:
            return False
        address = tensor.data_ptr()
        index = bisect.bisect_right(starts, address) - 1
        return index >= 0 and address < self._ends[tensor.device][index]
