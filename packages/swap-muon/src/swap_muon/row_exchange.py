"""One ``all_to_all`` per direction and batch: row blocks of ``Shard(0)`` matrices to their owners and back.

Every rank knows every parameter's shape, dtype and owner (the owner plan is
the same on all ranks), so each rank computes the same byte layout without
exchanging sizes: a rank's send buffer holds, per destination rank in order,
its rows of each matrix going there (in batch order); its receive buffer holds,
per source rank in order, the rows coming from there. Each piece starts at a
multiple of :data:`PIECE_ALIGN_BYTES`, so pieces of any dtype can be viewed
in place. Bytes move as ``uint8``: exact bits, whatever dtypes the transport
supports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from swap_core.adapters import align_up

from .rows import as_bytes, chunk_rows

__all__ = ["PIECE_ALIGN_BYTES", "gather_rows_to_owners", "scatter_rows_from_owners"]

PIECE_ALIGN_BYTES = 16
"""Start of every piece in a send or receive buffer: a multiple of any element size."""


def gather_rows_to_owners(
    local_rows: Sequence[torch.Tensor],
    shapes: Sequence[torch.Size],
    owners: Sequence[int],
    group: dist.ProcessGroup,
) -> list[torch.Tensor | None]:
    """Each matrix whole on its owner (``None`` on other ranks), from every rank's ``Shard(0)`` rows.

    ``local_rows[i]`` is this rank's block of matrix ``i`` (global shape ``shapes[i]``, owned by shard-group
    rank ``owners[i]``); all blocks share a device, and a matrix's dtype is its block's on every rank.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = _Layout(shapes, [block.dtype for block in local_rows], owners, size)
    for index, block in enumerate(local_rows):
        expected = layout.rows[index][rank]
        if block.shape[0] != expected:
            raise ValueError(
                f"Matrix {index} {tuple(shapes[index])}: this rank holds {block.shape[0]} rows, "
                f"torch.chunk over {size} ranks gives it {expected} (distributed Muon needs Shard(0) placements)"
            )
    device = local_rows[0].device if local_rows else torch.device("cpu")
    # To each owner: this rank's rows of the matrices it owns. From each rank: its rows of this rank's.
    send_sizes = [layout.total(layout.owned[dest], rank) for dest in range(size)]
    send = torch.empty(sum(send_sizes), dtype=torch.uint8, device=device)
    offset = 0
    for dest in range(size):
        for index in layout.owned[dest]:
            nbytes = layout.piece_bytes(index, rank)
            send[offset : offset + nbytes].copy_(as_bytes(local_rows[index]).reshape(-1))
            offset += align_up(nbytes, PIECE_ALIGN_BYTES)
    mine = layout.owned[rank]
    recv_sizes = [layout.total(mine, source) for source in range(size)]
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    fulls: list[torch.Tensor | None] = [None] * len(shapes)
    for index in mine:
        fulls[index] = torch.empty(shapes[index], dtype=layout.dtypes[index], device=device)
    offset = 0
    for source in range(size):
        for index in mine:
            nbytes = layout.piece_bytes(index, source)
            start = layout.first_row[index][source] * layout.row_bytes[index]
            full = fulls[index]
            assert full is not None
            full.view(-1).view(torch.uint8)[start : start + nbytes].copy_(recv[offset : offset + nbytes])
            offset += align_up(nbytes, PIECE_ALIGN_BYTES)
    return fulls


def scatter_rows_from_owners(
    fulls: Sequence[torch.Tensor | None],
    shapes: Sequence[torch.Size],
    dtype: torch.dtype,
    owners: Sequence[int],
    group: dist.ProcessGroup,
    device: torch.device,
) -> list[torch.Tensor]:
    """This rank's ``Shard(0)`` rows of every matrix, sent by its owner (``fulls[i]`` is set exactly there).

    Every matrix has ``dtype``; the returned blocks are views into one receive buffer on ``device``.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = _Layout(shapes, [dtype] * len(shapes), owners, size)
    mine = layout.owned[rank]
    for index, full in enumerate(fulls):
        if (full is not None) != (index in mine) or (full is not None and full.dtype != dtype):
            raise ValueError(
                f"Matrix {index}: its {dtype} value must be given on its owner (rank {owners[index]}) and only there"
            )
    # To each rank: its rows of the matrices this rank owns. From each owner: this rank's rows of its matrices.
    send_sizes = [layout.total(mine, dest) for dest in range(size)]
    send = torch.empty(sum(send_sizes), dtype=torch.uint8, device=device)
    offset = 0
    for dest in range(size):
        for index in mine:
            full = fulls[index]
            assert full is not None
            nbytes = layout.piece_bytes(index, dest)
            first = layout.first_row[index][dest]
            block = full[first : first + layout.rows[index][dest]]
            send[offset : offset + nbytes].copy_(as_bytes(block).reshape(-1))
            offset += align_up(nbytes, PIECE_ALIGN_BYTES)
    recv_sizes = [layout.total(layout.owned[source], rank) for source in range(size)]
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    blocks: list[torch.Tensor | None] = [None] * len(shapes)
    offset = 0
    for source in range(size):
        for index in layout.owned[source]:
            nbytes = layout.piece_bytes(index, rank)
            rows = (layout.rows[index][rank], *shapes[index][1:])
            blocks[index] = recv[offset : offset + nbytes].view(dtype).view(rows)
            offset += align_up(nbytes, PIECE_ALIGN_BYTES)
    received = [block for block in blocks if block is not None]
    assert len(received) == len(shapes), "every matrix has an owner"
    return received


class _Layout:
    """Row counts and byte sizes of each matrix's blocks, identical on every rank."""

    def __init__(
        self, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype], owners: Sequence[int], size: int
    ) -> None:
        self.dtypes = list(dtypes)
        self.owned = [[index for index, owner in enumerate(owners) if owner == rank] for rank in range(size)]
        """The matrices each rank owns, in batch order."""
        self.rows = [chunk_rows(shape[0], size) for shape in shapes]
        self.first_row = [[sum(rows[:rank]) for rank in range(size)] for rows in self.rows]
        self.row_bytes = [math.prod(shape[1:]) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)]

    def piece_bytes(self, index: int, rank: int) -> int:
        """Bytes of rank ``rank``'s rows of matrix ``index``."""
        return self.rows[index][rank] * self.row_bytes[index]

    def total(self, indices: Sequence[int], rank: int) -> int:
        """Bytes of rank ``rank``'s rows of the matrices ``indices``, each piece aligned: one buffer section."""
        return sum(align_up(self.piece_bytes(index, rank), PIECE_ALIGN_BYTES) for index in indices)
