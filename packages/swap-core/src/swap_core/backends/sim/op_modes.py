"""The base of the simulator's dispatch modes: every op of the program seen once, the simulator's own let through."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Mapping, Sequence

from swap_core.nesting import NestedFlag
from swap_core.torch_compat import OpOverload, TorchDispatchMode

__all__ = ["ProgramOpMode"]


class ProgramOpMode(TorchDispatchMode, abc.ABC):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """A dispatch mode that hands each op of the program to :meth:`run_op`; :meth:`paused` lets ops through."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._paused = NestedFlag()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Let the simulator's own copies and fills through (they are accounted for already)."""
        return self._paused.raised()

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        if self._paused.depth:
            return func(*args, **kwargs)
        return self.run_op(func, args, kwargs)

    @abc.abstractmethod
    def run_op(self, func: OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> object:
        """Run ``func`` (an op of the program) and return its result."""
