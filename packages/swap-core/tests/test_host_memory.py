"""Pinned host memory: exact-size versus caching-allocator rounding, the accounting, and the refusal when the host
is too small (all exact on the simulator, which models what a real device pins)."""

from __future__ import annotations

import copy
import gc
import mmap
import subprocess
import sys
import textwrap
import warnings
from collections import defaultdict
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.backends.host_memory import PAGE_BYTES, available_host_bytes, pinned_size
from swap_core.errors import HostMemoryError, PinnedMemoryWarning
from swap_core.sim import SimBackend
from swap_core.testing import planted
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
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)


def test_pinned_sizes_round_to_the_page_or_to_a_power_of_two() -> None:
    assert pinned_size(10 * MIB + 4, "exact") == 10 * MIB + PAGE_BYTES
    assert pinned_size(10 * MIB + 4, "caching") == 16 * MIB
    assert pinned_size(16 * MIB, "caching") == pinned_size(16 * MIB, "exact") == 16 * MIB
    assert pinned_size(1, "exact") == PAGE_BYTES and pinned_size(1, "caching") == 1
    assert pinned_size(0, "exact") == pinned_size(0, "caching") == 0
    assert PAGE_BYTES == mmap.PAGESIZE


def test_exact_pinning_rounds_to_the_hosts_page_where_it_is_64_kib() -> None:
    """Pages are 64 KiB on many aarch64 hosts (GH200): a host like that, simulated in a process of its own."""
    script = textwrap.dedent(
        """
        import mmap
        mmap.PAGESIZE = 65536
        import torch
        from swap_core.backends.host_memory import PAGE_BYTES, pinned_size
        from swap_core.backends.host_registration import registered_host_buffer

        class Registrar:
            def register(self, address, nbytes):
                print(nbytes)
            def unregister(self, address):
                pass

        print(PAGE_BYTES, pinned_size(1, "exact"), pinned_size(65537, "exact"), pinned_size(65537, "caching"))
        registered_host_buffer(10, torch.float32, Registrar())
        """
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["65536", "65536", "131072", "131072", "65536"]


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
    assert optimizer.stats.host_pinned_bytes == sim.host_pinned_bytes()  # (6 + 5) pages of 4 KiB, 2 of 64 KiB


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
    needed = pinned_size(29_000 * 4, "exact")  # both square_avgs in one buffer: 29 pages of 4 KiB, 2 of 64 KiB
    with pytest.raises(HostMemoryError, match=rf"needs 0\.00 GiB \({needed} bytes\) of pinned host memory") as raised:
        optimizer.step()
    message = str(raised.value)
    assert "host has 0.00 GiB (65536 bytes) available" in message and "Nothing was allocated" in message
    assert "offload_fraction < 1" in message and "state_keys" in message and "more ranks" in message
    assert isinstance(raised.value, MemoryError)
    assert sim.host_pinned_bytes() == 0
    assert all(not optimizer.state[param] for param in params), "the refused step left states behind"
    # Once the host has room, the same optimizer steps exactly as if the refused step never happened.
    sim.host_bytes = None
    _step_both(optimizer, reference, params, reference_params, range(3))
    _assert_pair_equal(optimizer, reference, params, reference_params, "after the refused step")


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
    _step_both(optimizer, reference, params, reference_params, range(2))
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
    _continue_and_compare(optimizer, reference, params, reference_params, "after the refused adoption")


class _CountedCopies(torch.overrides.TorchFunctionMode):
    """Counts ``Tensor.copy_`` calls whose destination is host memory (torch's public function-mode hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.into_host_mirrors = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_ and args[0].device.type == "cpu":
            self.into_host_mirrors += 1
        return func(*args, **(kwargs or {}))


def _adamw_pair(
    sim: SimBackend, numels: tuple[int, ...], *, packed: bool = True, bf16: bool = False
) -> tuple[Any, Any, list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """A swapped AdamW and a plain one over equal fp32 parameters (and a bf16 one), not stepped yet."""

    def make() -> list[torch.nn.Parameter]:
        made = _params(*numels)
        if bf16:
            made.append(torch.nn.Parameter(torch.randn(3000, generator=torch.Generator().manual_seed(1)).bfloat16()))
        return made

    params, reference_params = make(), make()
    reference = torch.optim.AdamW(reference_params, lr=1e-2)
    optimizer = swap_optimizer(torch.optim.AdamW(params, lr=1e-2), SwapConfig(backend=sim, min_numel=16, packed=packed))
    return optimizer, reference, params, reference_params


def _step_both(optimizer: Any, reference: Any, params: Any, reference_params: Any, steps: range) -> None:
    for step in steps:
        for group, opt in ((params, optimizer), (reference_params, reference)):
            _grads(group, step)
            opt.step()


def _trained_pair(
    sim: SimBackend, *, packed: bool
) -> tuple[Any, Any, list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """:func:`_adamw_pair` over fp32 and bf16 parameters, after two steps."""
    pair = _adamw_pair(sim, (20_000, 9000), packed=packed, bf16=True)
    _step_both(*pair, range(2))
    return pair


def _assert_pair_equal(optimizer: Any, reference: Any, params: Any, reference_params: Any, what: str) -> None:
    for index, (want, got) in enumerate(zip(reference_params, params, strict=True)):
        assert_bitwise_equal(want, got, f"parameter {index} {what}")
    assert_state_dicts_equal(reference.state_dict(), optimizer.state_dict(), what)


def _continue_and_compare(optimizer: Any, reference: Any, params: Any, reference_params: Any, what: str) -> None:
    _step_both(optimizer, reference, params, reference_params, range(2, 4))
    _assert_pair_equal(optimizer, reference, params, reference_params, what)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_a_resume_loads_into_the_live_host_mirrors_without_allocating(packed: bool) -> None:
    """A checkpoint of the live layout is copied into the mirrors in place: the pinned-host peak does not move."""
    sim = SimBackend(mode="random", seed=3)
    optimizer, reference, params, reference_params = _trained_pair(sim, packed=packed)
    checkpoint = copy.deepcopy(reference.state_dict())
    mirrors = [optimizer.state[param]["exp_avg"] for param in params]
    sim.reset_peak_memory_stats()
    pinned = sim.host_pinned_bytes()
    optimizer.load_state_dict(copy.deepcopy(checkpoint))  # each its own: torch's load keeps `step` tensors as given
    assert sim.max_host_pinned_bytes() == pinned, "loading a checkpoint of the live layout allocated host memory"
    assert all(optimizer.state[param]["exp_avg"] is mirror for param, mirror in zip(params, mirrors, strict=True))
    for index, param in enumerate(params):
        want = checkpoint["state"][index]["exp_avg"].to(param.dtype)
        assert_bitwise_equal(want, optimizer.state[param]["exp_avg"], f"exp_avg of parameter {index}")
    reference.load_state_dict(checkpoint)
    _continue_and_compare(optimizer, reference, params, reference_params, "after an in-place load")


def test_loading_its_own_state_dict_copies_nothing() -> None:
    """``state_dict()``'s tensors are the mirrors (what DCP loads into): loading them back copies no byte."""
    sim = SimBackend(mode="lazy")
    optimizer, reference, params, reference_params = _trained_pair(sim, packed=True)
    own = optimizer.state_dict()
    sim.reset_copy_stats()
    sim.reset_peak_memory_stats()
    pinned = sim.host_pinned_bytes()
    with _CountedCopies() as copies:
        optimizer.load_state_dict(own)
    assert sim.max_host_pinned_bytes() == pinned
    assert copies.into_host_mirrors == 0, "a mirror was copied onto itself"
    assert sim.copy_stats.h2d_copies == sim.copy_stats.d2h_copies == 0
    _continue_and_compare(optimizer, reference, params, reference_params, "after loading its own state dict")


def test_a_state_dict_permuting_live_mirrors_loads_as_torch_does() -> None:
    """States swapped between two parameters of one shape, as live mirrors: every value is read before any write."""
    optimizer, reference, params, reference_params = _adamw_pair(SimBackend(mode="sync"), (4000, 4000))
    _step_both(optimizer, reference, params, reference_params, range(2))
    for opt in (optimizer, reference):
        state_dict = opt.state_dict()
        state_dict["state"][0], state_dict["state"][1] = state_dict["state"][1], state_dict["state"][0]
        opt.load_state_dict(state_dict)
    _continue_and_compare(optimizer, reference, params, reference_params, "after a permuted load")


def test_a_checkpoint_of_another_layout_is_built_in_new_host_memory() -> None:
    """A checkpoint with states the live layout lacks: a new layout, held beside the old one until it is filled."""
    sim = SimBackend(mode="lazy")
    optimizer, reference, params, reference_params = _adamw_pair(sim, (20_000, 9000))
    for step in range(2):
        _grads(reference_params, step)
        reference.step()
        _grads(params[:1], step)  # the live optimizer has no state for the second parameter yet
        optimizer.step()
    before = sim.host_pinned_bytes()
    checkpoint = copy.deepcopy(reference.state_dict())
    sim.reset_peak_memory_stats()
    optimizer.load_state_dict(copy.deepcopy(checkpoint))  # each its own: torch's load keeps `step` tensors as given
    after = sim.host_pinned_bytes()
    assert after > before, "the second parameter's moments were not swapped"
    assert sim.max_host_pinned_bytes() == before + after
    with torch.no_grad():
        for param, loaded in zip(params, reference_params, strict=True):
            param.copy_(loaded)  # the model's half of the checkpoint
    reference.load_state_dict(checkpoint)
    _continue_and_compare(optimizer, reference, params, reference_params, "after loading another layout")


def test_a_relayout_in_caching_host_mode_gives_the_old_pinned_blocks_back() -> None:
    """torch's caching pinned allocator keeps a freed buffer's block pinned: after a re-layout (a parameter's first
    gradient here) the process would pin the old layout and the new one; the step empties that cache once."""
    sim = SimBackend(mode="lazy")
    params = [torch.nn.Parameter(torch.randn(64, 40)) for _ in range(4)]
    params[-1].requires_grad_(False)
    config = SwapConfig(backend=sim, min_numel=16, swap_times=2, host_memory="caching")
    optimizer = swap_optimizer(torch.optim.RMSprop(params), config)
    for step in range(3):
        if step == 1:
            params[-1].requires_grad_(True)
        for param in params:
            param.grad = torch.ones_like(param) if param.requires_grad else None
        optimizer.step()
        gc.collect()
        assert sim.host_pinned_bytes() == optimizer.stats.host_pinned_bytes, f"step {step}: the old layout stayed"
    assert optimizer.stats.host_pinned_bytes == pinned_size(4 * 64 * 40 * 4, "caching"), "one buffer of square_avg"


def test_the_simulated_caching_pinned_allocator_keeps_freed_blocks_until_emptied() -> None:
    sim = SimBackend()
    first = sim.empty_host(1000, torch.float32, mode="caching")  # a 4,096-byte block
    del first
    gc.collect()
    assert sim.host_pinned_bytes() == 4096, "freed, the block stays pinned in the cache"
    again = sim.empty_host(900, torch.float32, mode="caching")  # same block size: the cached block is reused
    assert sim.host_pinned_bytes() == 4096
    exact = sim.empty_host(1000, torch.float32)  # registered memory is unpinned when freed, never cached
    del again, exact
    gc.collect()
    assert sim.host_pinned_bytes() == 4096
    sim.empty_host_cache()
    assert sim.host_pinned_bytes() == 0


# -- packed host memory in chunks the driver registers ----------------------------------------
CHUNK_LIMIT = 40_000
"""Bytes the simulated driver registers at once in the tests below: three 12,000-byte states fit, not four."""


def _chunked_step_copies(limit: int, steps: int = 4) -> tuple[int, int, list[str]]:
    """Copies and bytes of a step of AdamW over six 3,000-element parameters, 2 batches, with the simulated driver
    registering at most ``limit`` bytes, checked bitwise against torch's AdamW at every step and every schedule; and
    the pinned-memory warnings raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mode in ("lazy", "random", "sync"):
            sim = SimBackend(mode=mode, seed=3, max_registration_bytes=limit)  # type: ignore[arg-type]
            params, plain_params = _params(*[3000] * 6), _params(*[3000] * 6)
            config = SwapConfig(backend=sim, swap_times=2, min_numel=16, packed=True)
            optimizer = swap_optimizer(torch.optim.AdamW(params, lr=1e-2), config)
            plain = torch.optim.AdamW(plain_params, lr=1e-2)
            for step in range(steps):
                _grads(params, step)
                _grads(plain_params, step)
                sim.reset_copy_stats()
                optimizer.step()
                plain.step()
                for index, (expected, actual) in enumerate(zip(plain_params, params, strict=True)):
                    assert_bitwise_equal(expected, actual, f"{mode} step {step}: parameter {index}")
                assert_state_dicts_equal(plain.state_dict(), optimizer.state_dict(), f"{mode} step {step}")
            assert not sim.races, sim.races
    copies = sim.copy_stats
    warned = [str(w.message) for w in caught if issubclass(w.category, PinnedMemoryWarning)]
    return copies.h2d_copies + copies.d2h_copies, copies.h2d_bytes + copies.d2h_bytes, warned


def test_packed_host_memory_pins_in_chunks_the_driver_registers() -> None:
    """Twelve 12,000-byte moments (12,032 apart) in a driver that registers at most 40,000 bytes at once: four
    chunks of three, each pinned at its exact size, no fallback; each batch moves one copy per chunk it touches
    (no more bytes), and the steps are bitwise torch's."""
    sim = SimBackend(max_registration_bytes=CHUNK_LIMIT)
    assert sim.max_host_buffer_bytes == CHUNK_LIMIT
    chunked, chunked_bytes, warned = _chunked_step_copies(CHUNK_LIMIT)
    whole, whole_bytes, _ = _chunked_step_copies(1 << 30)
    assert warned == [], warned
    payload = 2 * 12 * 12_000  # each way, the alignment gaps between states aside
    assert payload <= chunked_bytes <= whole_bytes, "no more bytes: the gaps at a chunk's end are not copied"
    assert chunked > whole, "a batch crossing a chunk's end moves with one copy per chunk"
    params = _params(*[3000] * 6)
    optimizer = swap_optimizer(
        torch.optim.AdamW(params, lr=1e-2), SwapConfig(backend=sim, swap_times=2, min_numel=16, packed=True)
    )
    _grads(params, 0)
    optimizer.step()
    assert optimizer.stats.host_pinned_bytes == 4 * pinned_size(12_032 * 2 + 12_000, "exact") == sim.host_pinned_bytes()


def test_one_buffer_per_dtype_over_the_drivers_limit_is_caught() -> None:
    """Planted: packed host memory in one buffer per dtype; the simulated driver refuses it (as some real ones refuse
    more than about 8-12 GiB), the backend falls back to the caching allocator and warns."""
    with planted.packed_host_in_one_buffer_per_dtype():
        _, _, warned = _chunked_step_copies(CHUNK_LIMIT, steps=1)
    assert any(f"over the {CHUNK_LIMIT}" in message for message in warned), warned


def test_a_registration_over_the_simulated_drivers_limit_falls_back_and_warns() -> None:
    sim = SimBackend(max_registration_bytes=2 * PAGE_BYTES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fits = sim.empty_host(2 * PAGE_BYTES // 4, torch.float32)
        over = sim.empty_host(2 * PAGE_BYTES // 4 + 1, torch.float32)
    assert sim.pinned_bytes(fits) == 2 * PAGE_BYTES
    assert sim.pinned_bytes(over) == pinned_size(2 * PAGE_BYTES + 4, "caching")
    assert [str(w.message) for w in caught if issubclass(w.category, PinnedMemoryWarning)] == [
        f"Simulated: exact-size pinning failed (a buffer of {2 * PAGE_BYTES + 4} bytes is over the "
        f"{2 * PAGE_BYTES} the simulated driver registers at once); host buffers come from the caching pinned "
        "allocator, which rounds each one up to a power of two"
    ]
    with pytest.raises(ValueError, match=r"Invalid max_registration_bytes: 0; expected an int > 0"):
        SimBackend(max_registration_bytes=0)


def test_a_step_inside_the_backward_copies_out_to_chunked_spare_copies_bitwise() -> None:
    """With provisional updates the spare host copies have the mirrors' chunks: a clip that binds on odd steps takes
    those back, the others commit, bitwise torch's loop and no fallback."""

    def model() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(3)))

    plain_model, swapped_model = model(), model()
    plain = torch.optim.RMSprop(plain_model.parameters(), lr=1e-2, momentum=0.9)
    sim = SimBackend(mode="random", seed=1, max_registration_bytes=10_000)  # two 4 KiB states a chunk
    config = SwapConfig(backend=sim, swap_times=2, min_numel=64, packed=True, step="in_backward")
    optimizer = swap_optimizer(torch.optim.RMSprop(swapped_model.parameters(), lr=1e-2, momentum=0.9), config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PinnedMemoryWarning)
        for step in range(5):
            inputs = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
            for this_model, this_opt in ((plain_model, plain), (swapped_model, optimizer)):
                this_model(inputs).square().mean().backward()
                torch.nn.utils.clip_grad_norm_(this_model.parameters(), max_norm=0.01 if step % 2 else 100.0)
                this_opt.step()
                this_opt.zero_grad(set_to_none=True)
            for (name, expected), actual in zip(
                plain_model.named_parameters(), swapped_model.parameters(), strict=True
            ):
                assert_bitwise_equal(expected, actual, f"step {step}: {name}")
            assert_state_dicts_equal(plain.state_dict(), optimizer.state_dict(), f"step {step}")
    assert optimizer.stats.host_spare_bytes > 0
    assert not sim.races, sim.races
