"""A flag that holds while any of its blocks is open: blocks nest, and the flag drops when the outermost ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["NestedFlag"]


class NestedFlag:
    """Raised inside :meth:`raised` blocks, which may nest (``depth`` counts the open ones)."""

    __slots__ = ("depth",)

    def __init__(self) -> None:
        self.depth = 0

    def __bool__(self) -> bool:
        return self.depth > 0

    @contextlib.contextmanager
    def raised(self) -> Iterator[None]:
        """The flag holds inside the block, whatever the block raises."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
