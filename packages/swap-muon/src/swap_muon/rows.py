"""Row blocks of ``Shard(0)`` matrices, as the collectives of distributed Muon move them."""

from __future__ import annotations

import torch

__all__ = ["as_bytes", "chunk_rows", "padded_rows"]


def chunk_rows(total: int, parts: int) -> list[int]:
    """Rows per rank under ``torch.chunk`` semantics (what ``Shard(0)`` uses), trailing ranks possibly empty.

    Every rank but the trailing ones holds ``max(rows)``, so the valid rows of the blocks padded to
    ``max(rows)`` and laid end to end are exactly the first ``total`` rows.
    """
    size = -(-total // parts)
    return [max(0, min(size, total - rank * size)) for rank in range(parts)]


def padded_rows(block: torch.Tensor, rows: int) -> torch.Tensor:
    """``block`` with zero rows appended up to ``rows`` (collectives need equal sizes on every rank)."""
    padded = block.new_zeros((rows, *block.shape[1:]))
    padded[: block.shape[0]].copy_(block)
    return padded


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A byte view: collectives move exact bits whatever dtypes the transport supports."""
    return tensor.contiguous().view(torch.uint8)
