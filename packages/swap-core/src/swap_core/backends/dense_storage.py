"""Which tensors densely fill their memory: the strides with which a whole storage can be freed and regrown."""

from __future__ import annotations

import torch

__all__ = ["is_dense", "spans_whole_storage"]


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements occupy exactly ``numel`` consecutive places, in some order of its dimensions.

    Contiguous, channels-last and transposed tensors are dense; a slice with a step, an expanded
    tensor or one with overlapping strides is not.
    """
    expected = 1
    dims = [(size, stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size != 1]
    for size, stride in sorted(dims, key=lambda dim: dim[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def spans_whole_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` starts at its storage's offset 0 and densely covers ``numel`` elements from there."""
    return tensor.storage_offset() == 0 and is_dense(tensor)
