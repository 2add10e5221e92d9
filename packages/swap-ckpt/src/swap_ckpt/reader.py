"""A DCP file-system reader that checks every data file against the metadata before reading a byte."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from .errors import CheckpointFileError

__all__ = ["CheckedFileSystemReader", "check_metadata"]


class CheckedFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that raises :class:`~swap_ckpt.errors.CheckpointFileError` naming the file.

    torch's reader finds a truncated data file only while reading it (after the
    state being loaded may already be partly overwritten) and reports a zip or
    unpickling error without the file's name. This one checks, when DCP sets it
    up and before any read, that every file the metadata refers to exists and
    is long enough for its entries. A missing ``.metadata`` is torch's own
    ``FileNotFoundError`` naming the path. Same-length corruption is not detected
    (DCP files carry no checksums).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.directory = Path(path)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        check_files(self.directory, metadata)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


def check_metadata(directory: str | os.PathLike[str]) -> Metadata:
    """The checkpoint's metadata, or :class:`~swap_ckpt.errors.CheckpointFileError` naming ``.metadata``.

    DCP's loader swallows a failing metadata read and raises an ``AssertionError`` ("metadata is
    None") that names no file; this reads it first and says which file is missing or unreadable.
    """
    reader = FileSystemReader(directory)
    path = Path(directory) / ".metadata"
    if not path.is_file():
        raise CheckpointFileError(f"Checkpoint metadata {path} is missing: not a DCP checkpoint directory?")
    try:
        metadata: Metadata = reader.read_metadata()
    except Exception as error:
        raise CheckpointFileError(
            f"Checkpoint metadata {path} is unreadable (truncated or corrupt?): {type(error).__name__}: {error}"
        ) from error
    return metadata


def check_files(directory: Path, metadata: Metadata) -> None:
    """Every data file of ``metadata`` exists in ``directory`` and holds its entries' bytes."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for relative_path, end in sorted(needed.items()):
        path = directory / relative_path
        if not path.is_file():
            raise CheckpointFileError(f"Checkpoint file {path} is missing (the metadata refers to it)")
        size = path.stat().st_size
        if size < end:
            raise CheckpointFileError(
                f"Checkpoint file {path} is truncated: {size} bytes, its entries need {end} (an incomplete copy?)"
            )
