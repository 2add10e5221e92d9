"""Pinned host memory: exact-size versus caching-allocator rounding, the accounting, and the refusal when the host
is too small (all exact on the simulator, which models what a real device pins)."""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.backends.host_memory import PAGE_BYTES, available_host_bytes, pinned_size
from swap_core.errors import HostMemoryError, PinnedMemoryWarning
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

pytestmark = pytest.mark.sim_only

MIB = 2**20
TEN_MIB_AND_FOUR = 10 * MIB // 4 + 1
"""float32 elements of a 10 MiB + 4 byte state."""


def _params(*numels: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(numel, generator=generator)) for numel in numels]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(10 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def test_pinned_sizes_round_to_the_page_or_to_a_power_of_two() -> None:
    assert pinned_size(10 * MIB + 4, "exact") == 10 * MIB + PAGE_BYTES
    assert pinned_size(10 * MIB + 4, "caching") == 16 * MIB
    assert pinned_size(16 * MIB, "caching") == pinned_size(16 * MIB, "exact") == 16 * MIB
    assert pinned_size(1, "exact") == PAGE_BYTES and pinned_size(1, "caching") == 1
    assert pinned_size(0, "exact") == pinned_size(0, "caching") == 0


def test_the_host_reports_its_available_memory() -> None:
    available = available_host_bytes()
    assert available is None or available > 0


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
@pytest.mark.parametrize(
    ("host_memory", "pinned"), [("exact", 10 * MIB + PAGE_BYTES), ("caching", 16 * MIB)], ids=["exact", "caching"]
)
def test_a_10_mib_state_pins_what_the_mode_says(packed: bool, host_memory: str, pinned: int) -> None:
    sim = SimBackend(mode="sync", check_races=False, poison=False)
    params = _params(TEN_MIB_AND_FOUR)
    config = SwapConfig(backend=sim, swap_times=1, min_numel=16, packed=packed, host_memory=host_memory)  # type: ignore[arg-type]
    optimizer = swap_optimizer(torch.optim.RMSprop(params, lr=1e-2), config)
    _grads(params, 0)
    optimizer.step()
    assert optimizer.stats.host_state_bytes == 10 * MIB + 4
    assert optimizer.stats.host_pinned_bytes == pinned == sim.host_pinned_bytes()


def test_every_dtype_buffer_is_rounded_on_its_own() -> None:
    sim = SimBackend(mode="sync", check_races=False, poison=False)
    params = [torch.nn.Parameter(torch.zeros(3000)), torch.nn.Parameter(torch.zeros(5000, dtype=torch.bfloat16))]
    optimizer = swap_optimizer(torch.optim.AdamW(params, lr=1e-2), SwapConfig(backend=sim, min_numel=16))
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    # Two moments per parameter, the second 64-byte aligned after the first in its dtype's buffer.
    fp32, bf16 = 12032 + 12000, 10048 + 10000
    assert optimizer.stats.host_state_bytes == fp32 + bf16
    assert optimizer.stats.host_pinned_bytes == pinned_size(fp32, "exact") + pinned_size(bf16, "exact")
    assert optimizer.stats.host_pinned_bytes == (6 + 5) * PAGE_BYTES == sim.host_pinned_bytes()


def test_a_failed_registration_falls_back_to_the_caching_rounding_and_warns_once() -> None:
    sim = SimBackend(mode="sync", exact_pinning=False)
    params = _params(5000, 3000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = swap_optimizer(torch.optim.RMSprop(params, lr=1e-2), SwapConfig(backend=sim, min_numel=16))
        _grads(params, 0)
        optimizer.step()
        _grads(params, 1)
        optimizer.step()
    messages = [str(w.message) for w in caught if issubclass(w.category, PinnedMemoryWarning)]
    assert len(messages) == 1 and "power of two" in messages[0]
    assert optimizer.stats.host_pinned_bytes == pinned_size((5000 + 3008) * 4, "caching") == 32768


def test_a_host_too_small_is_refused_before_anything_is_allocated_or_changed() -> None:
    sim = SimBackend(mode="lazy", host_bytes=64 * 1024)
    params, reference_params = _params(20_000, 9000), _params(20_000, 9000)
    reference = torch.optim.RMSprop(reference_params, lr=1e-2)
    optimizer = swap_optimizer(torch.optim.RMSprop(params, lr=1e-2), SwapConfig(backend=sim, min_numel=16))
    _grads(params, 0)
    with pytest.raises(HostMemoryError, match=r"needs 0\.00 GiB \(118784 bytes\) of pinned host memory") as raised:
        optimizer.step()
    message = str(raised.value)
    assert "host has 0.00 GiB (65536 bytes) available" in message and "Nothing was allocated" in message
    assert "offload_fraction < 1" in message and "state_keys" in message and "more ranks" in message
    assert isinstance(raised.value, MemoryError)
    assert sim.host_pinned_bytes() == 0
    assert all(not optimizer.state[param] for param in params), "the refused step left states behind"
    # Once the host has room, the same optimizer steps exactly as if the refused step never happened.
    sim.host_bytes = None
    for step in range(3):
        _grads(params, step)
        _grads(reference_params, step)
        optimizer.step()
        reference.step()
    for index, (want, got) in enumerate(zip(reference_params, params, strict=True)):
        assert_bitwise_equal(want, got, f"parameter {index}")
    assert_state_dicts_equal(reference.state_dict(), optimizer.state_dict(), "after the refused step")


def test_existing_states_that_do_not_fit_are_refused_at_wrap_time_with_the_plain_optimizer_untouched() -> None:
    params = _params(20_000)
    plain = torch.optim.RMSprop(params, lr=1e-2)
    _grads(params, 0)
    plain.step()
    state = plain.state
    hooks = {name: dict(value) for name, value in vars(plain).items() if name.startswith("_optimizer_")}
    with pytest.raises(HostMemoryError, match="host has"):
        swap_optimizer(plain, SwapConfig(backend=SimBackend(host_bytes=PAGE_BYTES), min_numel=16))
    assert plain.state is state and type(plain.state) is defaultdict
    assert {name: dict(value) for name, value in vars(plain).items() if name.startswith("_optimizer_")} == hooks
    _grads(params, 1)
    plain.step()  # still the plain optimizer it was


def test_host_memory_mode_is_validated() -> None:
    with pytest.raises(ValueError, match=r"Invalid SwapConfig\.host_memory: 'pinned'; expected one of"):
        SwapConfig(host_memory="pinned")  # type: ignore[arg-type]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_a_checkpoint_the_host_cannot_take_through_the_plain_optimizer_changes_nothing(packed: bool) -> None:
    """Loaded through the wrapped optimizer, the states are adopted at the next step: refused whole if too big."""
    sim = SimBackend(mode="lazy")
    params, reference_params = _params(20_000, 9000), _params(20_000, 9000)
    reference = torch.optim.RMSprop(reference_params, lr=1e-2)
    optimizer = swap_optimizer(
        torch.optim.RMSprop(params, lr=1e-2), SwapConfig(backend=sim, min_numel=16, packed=packed)
    )
    for step in range(2):
        for group, opt in ((params, optimizer), (reference_params, reference)):
            _grads(group, step)
            opt.step()
    checkpoint = reference.state_dict()
    optimizer.optimizer.load_state_dict(copy.deepcopy(checkpoint))
    loaded = optimizer.optimizer.state
    sim.host_bytes = sim.host_pinned_bytes() + PAGE_BYTES  # room for one more page, not for a second layout
    _grads(params, 2)
    with pytest.raises(HostMemoryError, match="Nothing was allocated"):
        optimizer.step()
    assert optimizer.optimizer.state is loaded, "the loaded states were replaced although nothing fitted"
    sim.host_bytes = None
    reference.load_state_dict(copy.deepcopy(checkpoint))
    for step in range(2, 4):
        for group, opt in ((params, optimizer), (reference_params, reference)):
            _grads(group, step)
            opt.step()
    for index, (want, got) in enumerate(zip(reference_params, params, strict=True)):
        assert_bitwise_equal(want, got, f"parameter {index}")
    assert_state_dicts_equal(reference.state_dict(), optimizer.state_dict(), "after the refused adoption")
