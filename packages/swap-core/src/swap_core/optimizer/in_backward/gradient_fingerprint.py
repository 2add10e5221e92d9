"""A tensor's fingerprint: integers computed on its device from its bits, equal for equal bits.

The bits are read as integers (16-bit floats as ``int16``, 32- and 64-bit ones as ``int32`` words, 8-bit as
``int8``), each multiplied by a fixed pseudo-random weight in ``[1, 64)`` of its position in a row of :data:`ROW`
elements, and each row summed: the row sums are the fingerprint. Words of one or two bytes are weighted and summed in
``int32`` (``2^15 * 2^6 * 2^9 = 2^30``), wider ones in ``int64`` (``2^31 * 2^6 * 2^9 = 2^46``): no sum overflows, so
equal bits give equal fingerprints exactly, and a change shows unless the weighted sum of its differences is zero in
every row it touches (for a change of one element, never).

Cost on the device, per element of a 16-bit gradient: the cast to ``int32`` (2 bytes read, 4 written), the multiply in
place (4 read, 4 written) and the row sums (4 read): 18 bytes. It runs in chunks of :data:`CHUNK` elements, so the
temporary is at most ``8 * CHUNK`` bytes; the fingerprint is one integer a row (a 256th of a 16-bit gradient's bytes).
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK", "ROW", "fingerprint"]

ROW = 512
"""Elements a row sum covers."""

CHUNK = ROW << 12
"""Elements fingerprinted at a time: at most 16 MiB of temporary in ``int64``, 8 MiB in ``int32``."""

_WEIGHT_SEED = 0x5A7
_WEIGHT_LIMIT = 1 << 6
_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
"""The integer type the bits of an element of each size are read as."""

_weights: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s fingerprint: an integer tensor on its device (empty for an empty tensor), computed on the current
    stream."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    words = tensor.detach().reshape(-1).view(_WORDS[tensor.element_size()])
    wide = torch.int32 if words.element_size() <= 2 else torch.int64
    weights = _row_weights(words.device, wide)
    sums = []
    for start in range(0, words.numel(), CHUNK):
        chunk = words[start : start + CHUNK].to(wide)
        full = chunk.numel() - chunk.numel() % ROW
        rows = chunk[:full].view(-1, ROW).mul_(weights)
        sums.append(rows.sum(dim=1, dtype=wide))
        if full < chunk.numel():
            sums.append(chunk[full:].mul_(weights[: chunk.numel() - full]).sum(dtype=wide).reshape(1))
    if not sums:
        return torch.zeros((0,), dtype=wide, device=words.device)
    return torch.cat(sums)


def _row_weights(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The weights of the positions in a row, on ``device`` (made once, from a fixed seed)."""
    weights = _weights.get((device, dtype))
    if weights is None:
        generator = torch.Generator().manual_seed(_WEIGHT_SEED)
        host = torch.randint(1, _WEIGHT_LIMIT, (ROW,), generator=generator, dtype=dtype)
        weights = _weights[(device, dtype)] = host.to(device)
    return weights
