"""A tensor's fingerprint: a few integers computed on its device from its bits, equal for equal bits.

The bits, read as integers (16-bit floats as ``int16``, 32- and 64-bit ones as ``int32`` words, 8-bit as ``int8``),
are summed in chunks of :data:`CHUNK` elements, each weighted by a fixed pseudo-random integer in ``[1, 1024)`` of its
position in the chunk; the chunk sums are the fingerprint. No sum can overflow an ``int64`` (``2^31 * 2^10 * 2^21 =
2^62``), so equal bits give equal fingerprints exactly, and a change shows unless the weighted sum of its differences
is zero in every chunk (for a change of one element, never; otherwise a chance of the order of one in the range of
the chunk sums).

Cost on the device: per chunk, one cast to ``int64`` (a temporary of ``8 * CHUNK`` bytes at most), one multiply in
place and one sum; the weights take ``8 * CHUNK`` bytes per device, once.
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK", "fingerprint"]

CHUNK = 1 << 21
"""Elements per chunk: 16 MiB of weights and at most 16 MiB of temporary on the device."""

_WEIGHT_SEED = 0x5A7
_WEIGHT_LIMIT = 1 << 10
_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
"""The integer type the bits of an element of each size are read as."""

_weights: dict[torch.device, torch.Tensor] = {}


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s fingerprint: an ``int64`` tensor on its device (empty for an empty tensor), computed on the
    current stream."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    flat = tensor.detach().reshape(-1)
    words = flat.view(_WORDS[flat.element_size()])
    weights = _chunk_weights(words.device)
    sums = []
    for start in range(0, words.numel(), CHUNK):
        chunk = words[start : start + CHUNK].to(torch.int64)
        sums.append(chunk.mul_(weights[: chunk.numel()]).sum())
    if not sums:
        return torch.zeros((0,), dtype=torch.int64, device=words.device)
    return torch.stack(sums)


def _chunk_weights(device: torch.device) -> torch.Tensor:
    """The weights of the positions in a chunk, on ``device`` (made once, from a fixed seed)."""
    weights = _weights.get(device)
    if weights is None:
        generator = torch.Generator().manual_seed(_WEIGHT_SEED)
        host = torch.randint(1, _WEIGHT_LIMIT, (CHUNK,), generator=generator, dtype=torch.int64)
        weights = _weights[device] = host.to(device)
    return weights
