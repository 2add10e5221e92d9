"""Per-op checks of compute code: use after free, host/device mixing, and race bookkeeping.

:class:`ComputeCheckMode` is a ``TorchDispatchMode`` pushed by
``SimBackend.compute_scope()`` only when race checks are on; with checks off nothing
intercepts ops, so the simulator costs nothing per op. Outside a compute scope no
op is checked at all: a read of released storage there segfaults like plain torch.

For every op that can touch data, the checker looks up each tensor argument's
storage: a registered device storage whose bytes were released raises
:class:`~swap_core.errors.SimUseAfterFreeError` *before* the kernel could segfault;
host memory and device memory in one op raise
:class:`~swap_core.errors.SimMixedDeviceError`; the op is then recorded as an
access of the thread's current stream (it touches device memory) or of the host
(host memory only). Tensors the simulator never registered (step counters,
scalars) are neutral and untracked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from swap_core.errors import SimMixedDeviceError, SimUseAfterFreeError
from swap_core.torch_compat import OpOverload, op_schema, storage_id

from .memory import MemoryKind, MemoryRegistry, StorageRecord, byte_span
from .op_modes import ProgramOpMode
from .race_checker import HOST_AGENT, AccessRequest, RaceChecker

__all__ = ["ComputeCheckMode", "ComputeOpChecker", "OpAccessPattern", "op_access_pattern"]

_NO_DATA_ACCESS_OPS = frozenset(
    {
        # metadata and aliasing that `is_view` does not flag
        "detach",
        "alias",
        "lift_fresh",
        "set_",
        "resize_",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "size",
        "stride",
        "numel",
        "dim",
        "is_contiguous",
        "is_same_size",
        "is_set_to",
        "is_non_overlapping_and_dense",
        "result_type",
        "_has_compatible_shallow_copy_type",
        "record_stream",
        # factories that only read their argument's shape, dtype and device
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
    }
)


@dataclass(frozen=True, slots=True)
class OpAccessPattern:
    """What the schema of one op overload says about its tensor arguments (computed once per overload)."""

    name: str
    touches_data: bool
    write_positions: frozenset[int]
    write_names: frozenset[str]
    returns_host_value: bool


_patterns: dict[OpOverload, OpAccessPattern] = {}


def op_access_pattern(func: OpOverload) -> OpAccessPattern:
    """Which arguments ``func`` mutates (``Tensor(a!)`` and ``Tensor(a!)[]``), cached per overload."""
    pattern = _patterns.get(func)
    if pattern is None:
        schema = op_schema(func)
        pattern = OpAccessPattern(
            name=schema.name,
            touches_data=not (schema.is_view or schema.packet in _NO_DATA_ACCESS_OPS),
            write_positions=frozenset(index for index, _ in schema.written_arguments),
            write_names=frozenset(name for _, name in schema.written_arguments),
            returns_host_value=schema.returns_non_tensor,
        )
        _patterns[func] = pattern
    return pattern


def _tensor_arguments(
    pattern: OpAccessPattern, args: Sequence[object], kwargs: Mapping[str, object]
) -> Iterator[tuple[torch.Tensor, bool]]:
    """Every tensor argument (lists flattened) with whether the op writes it."""
    for index, value in enumerate(args):
        yield from _tensors_in(value, index in pattern.write_positions)
    for name, value in kwargs.items():
        yield from _tensors_in(value, name in pattern.write_names)


def _tensors_in(value: object, is_write: bool) -> Iterator[tuple[torch.Tensor, bool]]:
    if isinstance(value, torch.Tensor):
        yield value, is_write
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item, is_write


class ComputeOpChecker:
    """The checks of one backend, shared by every compute scope it opens."""

    def __init__(
        self,
        registry: MemoryRegistry,
        races: RaceChecker,
        tick: Callable[[], None],
        issue_on_current: Callable[[], str],
        host_waits_for: Callable[[str], None],
    ) -> None:
        """``issue_on_current()``: the agent of the thread's current stream, an op of which is about to run;
        ``host_waits_for(agent)``: the host blocked until that stream's work so far completed."""
        self._registry = registry
        self._races = races
        self._tick = tick
        self._issue_on_current = issue_on_current
        self._host_waits_for = host_waits_for

    def before(self, pattern: OpAccessPattern, args: Sequence[object], kwargs: Mapping[str, object]) -> str | None:
        """Check one op before it runs; returns the agent it was recorded on, if any."""
        self._tick()
        requests: list[AccessRequest] = []
        host_example: torch.Tensor | None = None
        device_example: torch.Tensor | None = None
        for tensor, is_write in _tensor_arguments(pattern, args, kwargs):
            if tensor.device.type != "cpu" or tensor.numel() == 0:
                continue
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):  # wrapper subclasses have no storage of their own
                continue
            lo, hi = byte_span(tensor)
            key = storage_id(storage)
            record = self._registry.lookup(key)
            if storage.nbytes() < hi:
                raise SimUseAfterFreeError(_use_after_free_message(pattern.name, tensor, record, hi, storage.nbytes()))
            if record is None:
                continue
            if record.is_host:
                host_example = tensor
            else:
                device_example = tensor
            requests.append(AccessRequest(key, record.kind.value, lo, hi, is_write))
        if host_example is not None and device_example is not None:
            raise SimMixedDeviceError(
                f"{pattern.name} mixes host memory (a {_describe(host_example)}) with simulated device memory "
                f"(a {_describe(device_example)}); move data between them with SimBackend.copy on a stream"
            )
        if not requests:
            return None
        agent = self._issue_on_current() if device_example is not None else HOST_AGENT
        self._races.access(agent, requests, pattern.name)
        return agent

    def after(self, pattern: OpAccessPattern, agent: str | None) -> None:
        """An op that hands a Python value of device memory back (``.item()``) made the host wait for its stream.

        Only tracked device memory counts: a plain tensor may be a CPU step
        counter, whose ``.item()`` synchronizes nothing on a real device.
        """
        if agent is not None and agent != HOST_AGENT and pattern.returns_host_value:
            self._host_waits_for(agent)


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {tensor.dtype} tensor"


def _use_after_free_message(
    op: str, tensor: torch.Tensor, record: StorageRecord | None, needed: int, available: int
) -> str:
    if record is not None and record.kind is MemoryKind.DEVICE:
        cause = "its device storage was released with release_storage; call restore_storage before using it"
    else:
        cause = "its storage was shrunk (resize_); reading it would crash the process"
    return (
        f"{op} touches a {_describe(tensor)} whose storage holds {available} bytes but the tensor needs {needed}: "
        f"{cause}"
    )


class ComputeCheckMode(ProgramOpMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Runs :class:`ComputeOpChecker` on every op; internal copies of the simulator pause it."""

    def __init__(self, checker: ComputeOpChecker) -> None:
        super().__init__()
        self._checker = checker

    def run_op(self, func: OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> object:
        pattern = op_access_pattern(func)
        if not pattern.touches_data:
            return func(*args, **kwargs)
        agent = self._checker.before(pattern, args, kwargs)
        result = func(*args, **kwargs)
        self._checker.after(pattern, agent)
        return result
