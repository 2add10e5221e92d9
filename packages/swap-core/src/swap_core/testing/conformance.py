"""The conformance suite every adapter passes: parity, accounting, checkpoints, faults, torch habits.

Per-family quirks are data (:class:`ConformanceCase` rows), not copied test
code. A family package's test module is three lines::

    from swap_core.testing.conformance import ConformanceCase, make_conformance_tests
    CASES = [ConformanceCase("adamw", lambda groups: torch.optim.AdamW(groups, lr=1e-2))]
    globals().update(make_conformance_tests(CASES))

Each check builds two identical parameter sets, drives the unwrapped optimizer
and the swapped one with the same gradients, and compares them bitwise.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..adapters.base import UpdateBatch
from ..alignment import align_up
from ..backends.protocol import DeviceBackend
from ..optimizer import SwapOptimizer
from ..runtime.packed import ARENA_ALIGN_BYTES, SLOT_ALIGN_BYTES
from .compare import assert_bitwise_equal, assert_state_dicts_equal
from .habits import HABIT_CHECKS
from .masters import assert_stepped_in_backward, check_master_weights
from .pairs import (
    BackendFactory,
    ConformanceCase,
    Pair,
    make_groups,
    make_pair,
    skips_a_gradient,
    swap_config,
    through_torch_save,
    wrap_case,
)
from .views import BatchView, planned_batches, simulator_of

if TYPE_CHECKING:
    import pytest

__all__ = [
    "CLIP_NORMS",
    "MASTER_MODES",
    "SIM_MODES",
    "ConformanceCase",
    "FaultPoint",
    "check_accounting",
    "check_checkpoint_round_trip",
    "check_clipped_in_backward",
    "check_fault",
    "check_parity",
    "fault_points",
    "make_conformance_tests",
    "through_torch_save",
]

SIM_MODES: tuple[tuple[str, int], ...] = (("lazy", 0), ("sync", 0), *(("random", seed) for seed in range(20)))
"""Simulator schedules every parity check runs under: lazy, sync and 20 random seeds."""

OPTION_VARIANTS: tuple[dict[str, Any], ...] = (
    {"keep_staging": True},
    {"keep_staging": True, "packed": False},
    {"offload_fraction": 0.5},
    {"offload_fraction": 0.0},
    {"swap_times": 1},
    {"swap_times": 8, "duplex": False},
    {"max_batch_bytes": 4096, "swap_times": 1},
    {"min_numel": 0, "swap_times": 5},
    {"state_keys": ()},
    {"prefetch": "backward", "swap_times": 3},
    {"prefetch": "backward", "offload_fraction": 0.5, "packed": False},
    {"step": "in_backward"},
    {"step": "in_backward", "packed": False, "swap_times": 5},
    {"step": "in_backward", "offload_fraction": 0.5, "duplex": False},
    {"step": "in_backward", "free_gradients": True},
    {"staging_buffers": 3, "swap_times": 5},
    {"step": "in_backward", "staging_buffers": 3, "packed": False, "swap_times": 5},
    {"step": "in_backward", "staging_buffers": 4, "swap_times": 6},
)
"""SwapConfig variants each checked for parity under :data:`OPTION_MODES`."""

OPTION_MODES: tuple[tuple[str, int], ...] = (("lazy", 0), ("sync", 0), ("random", 1), ("random", 2))

MASTER_MODES: tuple[tuple[str, int], ...] = (("lazy", 0), ("sync", 0), ("random", 1), ("random", 2))
"""Schedules of the master-weights checks (each with the packed and the per-tensor layout)."""

ACCOUNTING_BATCHING: tuple[tuple[int, int], ...] = ((1, 2), (3, 2), (8, 2), (3, 3), (8, 3))
"""``(swap_times, staging_buffers)`` of the accounting checks."""

BATCHING_IDS = [f"{swap_times}x{buffers}" for swap_times, buffers in ACCOUNTING_BATCHING]
"""``8x3``: 8 batches, 3 staged at a time."""

HABIT_MODES: tuple[tuple[str, int], ...] = (("lazy", 0), ("random", 5))
"""Schedules of the torch-habit checks: lazy (the last offload of a step is still queued when the user edits
between steps, so a host access that does not wait for it reads stale values) and one random seed."""


class InjectedUpdateFault(RuntimeError):
    """Raised by the conformance suite inside an adapter update to test recovery."""


@dataclasses.dataclass(frozen=True)
class FaultPoint:
    """Where a step is made to fail: an adapter update, or the n-th copy of a direction."""

    kind: str
    index: int

    def __str__(self) -> str:
        return f"{self.kind}{self.index}"


# -- checks ------------------------------------------------------------------
def check_parity(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """Bitwise parity with the unwrapped optimizer after every step, and no race on the simulator."""
    pair = make_pair(case, backend, **overrides)
    for step in range(case.steps):
        pair.step_both()
        # Parameters only: state_dict() synchronizes, which would hide a missing wait between steps.
        pair.assert_params_equal(f"{case.name} step {step}")
        if step > 0 and not skips_a_gradient(case, step):
            assert_stepped_in_backward(pair.swapped, f"{case.name} step {step}")
    pair.assert_equal(f"{case.name} after {case.steps} steps")
    races = getattr(backend, "races", [])
    assert not races, f"{case.name}: the simulator reported races: {races}"


CLIP_NORMS = (1e30, 1e-3)
"""The total norms the clipping check clips to on even and odd steps: one that never binds (``clip_grad_norm_``
multiplies by exactly 1) and one that always does."""


def check_clipped_in_backward(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """``SwapConfig(step="in_backward")`` with ``clip_grad_norm_`` between backward and step, on both optimizers,
    binding on odd steps only: bitwise the plain loop after every step; a step that clipped takes back every batch
    the backward updated, one that did not commits them."""
    pair = make_pair(case, backend, **{**overrides, "step": "in_backward"})
    for step in range(case.steps):
        pair.max_norm = CLIP_NORMS[step % 2]
        pair.step_both()
        where = f"{case.name} step {step}, clipped to {pair.max_norm}"
        pair.assert_params_equal(where)
        stats = pair.swapped.stats
        if step == 0 or skips_a_gradient(case, step):
            continue
        if step % 2:
            assert stats.batches_taken_back > 0 and stats.batches_in_backward == 0, f"{where}: {stats}"
        else:
            assert stats.batches_taken_back == 0, f"{where}: {stats}"
            assert_stepped_in_backward(pair.swapped, where)
    pair.assert_equal(f"{case.name} after {case.steps} clipped steps")
    races = getattr(backend, "races", [])
    assert not races, f"{case.name}: the simulator reported races: {races}"


def check_accounting(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """Exact device bytes and copy counts of a step, measured by the simulator."""
    pair = make_pair(case, backend, **overrides)
    sim = simulator_of(backend)
    pair.step_both()  # the first step creates the states
    packed, buffers = pair.swapped.config.packed, pair.swapped.config.staging_buffers
    batches = planned_batches(pair.swapped)
    for _ in range(2):
        sim.reset_copy_stats()
        before = backend.memory_allocated()
        backend.reset_peak_memory_stats()
        pair.step_both()
        backend.synchronize()
        stats = pair.swapped.stats
        peak = backend.max_memory_allocated() - before
        expected_copies = _expected_copies(batches, packed, buffers)
        copies = sim.copy_stats
        assert copies.h2d_copies == copies.d2h_copies == expected_copies == stats.h2d_copies == stats.d2h_copies, (
            f"{case.name}: expected {expected_copies} copies each way, simulator saw {copies}, stats say {stats}"
        )
        assert copies.h2d_bytes == stats.h2d_bytes == copies.d2h_bytes == stats.d2h_bytes
        assert peak == stats.peak_state_device_bytes - stats.resident_state_device_bytes, (
            f"{case.name}: simulator peak {peak} B, stats claim {stats.peak_state_device_bytes} B"
        )
        assert peak <= _staging_bound(batches, packed, buffers), f"{case.name}: peak {peak} B over the bound"
        if not pair.swapped.config.keep_staging:
            assert backend.memory_allocated() == before, f"{case.name}: device bytes leaked by a step"
        assert stats.batches == len(batches)
    pair.assert_equal(f"{case.name} after accounting steps")


def check_checkpoint_round_trip(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> None:
    """Swapped -> plain and plain -> swapped through ``torch.save``/``torch.load(weights_only=True)``."""
    pair = make_pair(case, backend, **overrides)
    pair.step_both(3)
    # swapped checkpoint -> fresh plain optimizer
    restored_plain = case.make_optimizer(make_groups(case, pair.reference_params))
    restored_plain.load_state_dict(through_torch_save(pair.swapped.state_dict()))
    pair.reference = restored_plain
    pair.step_both(2)
    pair.assert_equal(f"{case.name} swapped -> plain")
    # plain checkpoint -> fresh swapped optimizer
    fresh = case.make_optimizer(make_groups(case, pair.swapped_params))
    restored_swapped = wrap_case(case, fresh, swap_config(case, backend, **overrides))
    restored_swapped.load_state_dict(through_torch_save(pair.reference.state_dict()))
    pair.swapped = restored_swapped
    pair.step_both(2)
    pair.assert_equal(f"{case.name} plain -> swapped")


def fault_points(case: ConformanceCase, backend: DeviceBackend, **overrides: Any) -> list[FaultPoint]:
    """Every batch update and every copy call of one step of ``case``."""
    pair = make_pair(case, backend, **overrides)
    sim = simulator_of(backend)
    pair.step_both()
    batches = len(planned_batches(pair.swapped))
    sim.reset_copy_stats()
    pair.step_both()
    copies = sim.copy_stats
    return [
        *(FaultPoint("update", index) for index in range(batches)),
        *(FaultPoint("h2d", index) for index in range(copies.h2d_copies)),
        *(FaultPoint("d2h", index) for index in range(copies.d2h_copies)),
    ]


def check_fault(case: ConformanceCase, backend: DeviceBackend, point: FaultPoint, **overrides: Any) -> None:
    """A step failing at ``point`` loses nothing, leaks nothing, and the next steps are exact."""
    pair = make_pair(case, backend, **overrides)
    pair.step_both(2)
    pair.swapped.synchronize()
    baseline = backend.memory_allocated()
    before = _snapshot(pair.swapped)
    with _armed(pair.swapped, backend, point):
        try:
            pair.step_swapped()
        except (InjectedUpdateFault, RuntimeError):
            pass
        else:
            raise AssertionError(f"{case.name}: the fault at {point} was not raised")
    pair.swapped.synchronize()
    assert backend.memory_allocated() == baseline, f"{case.name}: device bytes leaked after a fault at {point}"
    pair.step_reference()
    after = _snapshot(pair.swapped)
    _assert_each_param_consistent(pair, before, after, point)
    # Continue from whatever the failed step left: a plain optimizer loaded with it must agree.
    reference = case.make_optimizer(make_groups(case, pair.reference_params))
    for mine, theirs in zip(pair.reference_params, pair.swapped_params, strict=True):
        mine.data.copy_(theirs.data)
    reference.load_state_dict(through_torch_save(pair.swapped.state_dict()))
    pair.reference = reference
    pair.steps_taken += 1
    pair.step_both(3)
    pair.assert_equal(f"{case.name} after a fault at {point}")


# -- pytest glue ---------------------------------------------------------------
def make_conformance_tests(cases: Sequence[ConformanceCase]) -> dict[str, Callable[..., None]]:
    """Parametrized pytest functions running every check over ``cases``; update a test module's globals."""
    import pytest

    case_param = pytest.mark.parametrize("case", cases, ids=str)
    return {
        **_parity_tests(case_param),
        **_clipping_tests(case_param),
        **_accounting_tests(case_param),
        **_state_tests(case_param),
        **_master_and_habit_tests(case_param),
    }


def _parity_tests(case_param: pytest.MarkDecorator) -> dict[str, Callable[..., None]]:
    """Parity under every schedule, layout and option."""
    import pytest

    layouts = pytest.mark.parametrize(
        "packed,duplex", [(True, True), (True, False), (False, True), (False, False)], ids=_layout_id
    )

    @case_param
    @layouts
    @pytest.mark.parametrize("mode,seed", SIM_MODES, ids=[f"{m}{s}" for m, s in SIM_MODES])
    def test_conformance_parity(
        case: ConformanceCase,
        packed: bool,
        duplex: bool,
        mode: str,
        seed: int,
        swap_backend_factory: BackendFactory,
        backend_name: str,
    ) -> None:
        _require_device_type(case, backend_name)
        check_parity(case, swap_backend_factory(mode=mode, seed=seed), packed=packed, duplex=duplex)

    @case_param
    @pytest.mark.parametrize("options", OPTION_VARIANTS, ids=_options_id)
    @pytest.mark.parametrize("mode,seed", OPTION_MODES, ids=[f"{m}{s}" for m, s in OPTION_MODES])
    def test_conformance_options(
        case: ConformanceCase,
        options: dict[str, Any],
        mode: str,
        seed: int,
        swap_backend_factory: BackendFactory,
        backend_name: str,
    ) -> None:
        _require_device_type(case, backend_name)
        check_parity(case, swap_backend_factory(mode=mode, seed=seed), **options)

    return {"test_conformance_parity": test_conformance_parity, "test_conformance_options": test_conformance_options}


def _clipping_tests(case_param: pytest.MarkDecorator) -> dict[str, Callable[..., None]]:
    """Clipping between the backward and a step begun inside it, packed and per tensor."""
    import pytest

    @case_param
    @pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
    @pytest.mark.parametrize("mode,seed", OPTION_MODES, ids=[f"{m}{s}" for m, s in OPTION_MODES])
    def test_conformance_clipped_in_backward(
        case: ConformanceCase,
        packed: bool,
        mode: str,
        seed: int,
        swap_backend_factory: BackendFactory,
        backend_name: str,
    ) -> None:
        _require_device_type(case, backend_name)
        check_clipped_in_backward(case, swap_backend_factory(mode=mode, seed=seed), packed=packed)

    return {"test_conformance_clipped_in_backward": test_conformance_clipped_in_backward}


def _accounting_tests(case_param: pytest.MarkDecorator) -> dict[str, Callable[..., None]]:
    """Exact accounting, packed and per tensor, under every batching."""
    import pytest

    @case_param
    @pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
    @pytest.mark.parametrize("swap_times,buffers", ACCOUNTING_BATCHING, ids=BATCHING_IDS)
    @pytest.mark.sim_only
    def test_conformance_accounting(
        case: ConformanceCase,
        packed: bool,
        swap_times: int,
        buffers: int,
        swap_backend_factory: BackendFactory,
        backend_name: str,
    ) -> None:
        _require_device_type(case, backend_name)
        backend = swap_backend_factory(mode="lazy")
        check_accounting(case, backend, packed=packed, swap_times=swap_times, staging_buffers=buffers)

    return {"test_conformance_accounting": test_conformance_accounting}


def _state_tests(case_param: pytest.MarkDecorator) -> dict[str, Callable[..., None]]:
    """Checkpoints and faults, each after the backward and inside it."""
    import pytest

    steps = pytest.mark.parametrize("step", ["after_backward", "in_backward"])

    @case_param
    @pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
    @steps
    def test_conformance_checkpoint(
        case: ConformanceCase, packed: bool, step: str, swap_backend_factory: BackendFactory, backend_name: str
    ) -> None:
        _require_device_type(case, backend_name)
        check_checkpoint_round_trip(case, swap_backend_factory(mode="random", seed=7), packed=packed, step=step)

    @case_param
    @pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
    @steps
    @pytest.mark.sim_only
    def test_conformance_faults(
        case: ConformanceCase, packed: bool, step: str, swap_backend_factory: BackendFactory, backend_name: str
    ) -> None:
        _require_device_type(case, backend_name)
        points = fault_points(case, swap_backend_factory(mode="lazy"), packed=packed, step=step)
        assert points, f"{case.name}: no fault points found"
        for point in points:
            check_fault(case, swap_backend_factory(mode="lazy"), point, packed=packed, step=step)

    return {
        "test_conformance_checkpoint": test_conformance_checkpoint,
        "test_conformance_faults": test_conformance_faults,
    }


def _master_and_habit_tests(case_param: pytest.MarkDecorator) -> dict[str, Callable[..., None]]:
    """Master weights and torch habits, each after the backward and inside it."""
    import pytest

    master_runs = [
        *(("after_backward", mode, seed) for mode, seed in MASTER_MODES),
        *(("in_backward", mode, seed) for mode, seed in MASTER_MODES[::2]),
    ]

    @case_param
    @pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
    @pytest.mark.parametrize("step,mode,seed", master_runs, ids=[f"{step}-{m}{s}" for step, m, s in master_runs])
    def test_conformance_master_weights(
        case: ConformanceCase,
        packed: bool,
        step: str,
        mode: str,
        seed: int,
        swap_backend_factory: BackendFactory,
        backend_name: str,
    ) -> None:
        _require_device_type(case, backend_name)
        check_master_weights(case, swap_backend_factory(mode=mode, seed=seed), packed=packed, step=step)

    @case_param
    @pytest.mark.parametrize("habit", list(HABIT_CHECKS))
    @pytest.mark.parametrize("step", ["after_backward", "in_backward"])
    @pytest.mark.parametrize("mode,seed", HABIT_MODES, ids=[f"{m}{s}" for m, s in HABIT_MODES])
    def test_conformance_torch_habits(
        case: ConformanceCase,
        habit: str,
        step: str,
        mode: str,
        seed: int,
        swap_backend_factory: BackendFactory,
        backend_name: str,
    ) -> None:
        _require_device_type(case, backend_name)
        HABIT_CHECKS[habit](case, swap_backend_factory(mode=mode, seed=seed), step=step)

    return {
        "test_conformance_master_weights": test_conformance_master_weights,
        "test_conformance_torch_habits": test_conformance_torch_habits,
    }


# -- helpers -----------------------------------------------------------------------
def _require_device_type(case: ConformanceCase, backend_name: str) -> None:
    """Skip ``case`` on a backend whose device type its optimizer does not run on."""
    import pytest

    device_type = "cpu" if backend_name == "sim" else backend_name
    if case.device_types is not None and device_type not in case.device_types:
        pytest.skip(f"{case.name}: the optimizer runs on {', '.join(case.device_types)} only, not on {device_type}")


def _options_id(options: Mapping[str, Any]) -> str:
    return "-".join(f"{key}={value}" for key, value in options.items())


def _layout_id(value: object) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def _expected_copies(batches: Sequence[BatchView], packed: bool, buffers: int) -> int:
    """Copies per direction: one per state per-tensor; packed, one per dtype region of a batch, two where a region
    crosses the middle of the arena (cut there when an arena is reused, with more batches than ``buffers``)."""
    if not packed:
        return sum(len(batch.states) for batch in batches)
    regions = [_dtype_regions(batch) for batch in batches]
    if len(batches) <= buffers:
        return sum(len(batch_regions) for batch_regions in regions)
    arenas = _arena_sizes([sum(align_up(n, ARENA_ALIGN_BYTES) for _, n in r) for r in regions], buffers)
    copies = 0
    for index, batch_regions in enumerate(regions):
        middle = align_up(arenas[index % buffers] // 2, ARENA_ALIGN_BYTES)
        offset = 0
        for _, nbytes in batch_regions:
            copies += 2 if offset < middle < offset + nbytes else 1
            offset += align_up(nbytes, ARENA_ALIGN_BYTES)
    return copies


def _dtype_regions(batch: BatchView) -> list[tuple[torch.dtype, int]]:
    """A batch's dtype regions in arena order (by dtype name): each state 64-byte aligned after the previous one."""
    ends: dict[torch.dtype, int] = {}
    for state in batch.states:
        ends[state.dtype] = align_up(ends.get(state.dtype, 0), SLOT_ALIGN_BYTES) + state.nbytes
    return sorted(ends.items(), key=lambda item: str(item[0]))


def _staging_bound(batches: Sequence[BatchView], packed: bool, buffers: int) -> int:
    """``buffers`` staged batches: per batch, each state 64-byte aligned, each dtype region 512-byte aligned."""
    arenas: list[int] = []
    sizes: list[int] = []
    for batch in batches:
        arenas.append(sum(align_up(nbytes, ARENA_ALIGN_BYTES) for _, nbytes in _dtype_regions(batch)))
        sizes.append(sum(state.nbytes for state in batch.states))
    if packed:
        return sum(_arena_sizes(arenas, buffers))
    windows = [sum(sizes[start : start + buffers]) for start in range(max(len(sizes) - buffers, 0) + 1)]
    return max(windows)


def _arena_sizes(batch_bytes: Sequence[int], buffers: int) -> list[int]:
    """The staging arenas (at most one a batch): arena ``j`` is the largest of the batches ``j`` modulo
    ``buffers``."""
    count = min(buffers, len(batch_bytes))
    return [align_up(max(batch_bytes[first::buffers]), ARENA_ALIGN_BYTES) for first in range(count)]


def _snapshot(optimizer: SwapOptimizer) -> dict[str, Any]:
    params = [param.detach().clone() for group in optimizer.param_groups for param in group["params"]]
    return {"params": params, "state": copy.deepcopy(optimizer.state_dict()["state"])}


def _assert_each_param_consistent(pair: Pair, before: dict[str, Any], after: dict[str, Any], point: FaultPoint) -> None:
    """Each parameter, with its state, is either untouched or exactly the reference's updated values."""
    stepped = pair.reference.state_dict()["state"]
    for index, param in enumerate(after["params"]):
        updated = not _same_bytes(param, before["params"][index])
        if updated:
            assert_bitwise_equal(pair.reference_params[index], param, f"fault at {point}: parameter {index}")
            expected_state = stepped.get(index, {})
        else:
            expected_state = before["state"].get(index, {})
        actual_state = after["state"].get(index, {})
        assert_state_dicts_equal(
            {"state": {index: expected_state}, "param_groups": []},
            {"state": {index: actual_state}, "param_groups": []},
            f"fault at {point}: state of parameter {index} ({'updated' if updated else 'untouched'})",
        )


class _armed:
    """Arms one fault for the duration of a block (an adapter exception or a simulator copy fault)."""

    def __init__(self, optimizer: SwapOptimizer, backend: DeviceBackend, point: FaultPoint) -> None:
        self.optimizer = optimizer
        self.backend = backend
        self.point = point

    def __enter__(self) -> None:
        if self.point.kind == "update":
            adapter = self.optimizer.adapter
            original = adapter.update
            target = self.point.index

            def failing_update(batch: UpdateBatch) -> None:
                if batch.batch_index == target:
                    raise InjectedUpdateFault(f"injected update fault in batch {target}")
                original(batch)

            adapter.update = failing_update  # type: ignore[method-assign]
        else:
            simulator_of(self.backend).fail_copy(self.point.index, direction=self.point.kind)

    def __exit__(self, *exc: object) -> None:
        if self.point.kind == "update":
            del self.optimizer.adapter.update


def _same_bytes(first: torch.Tensor, second: torch.Tensor) -> bool:
    """``torch.equal`` on the bytes: NaN == NaN here, unlike value equality."""
    return torch.equal(first.reshape(-1).view(torch.uint8), second.reshape(-1).view(torch.uint8))
