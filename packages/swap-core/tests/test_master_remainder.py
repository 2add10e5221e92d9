"""An fp32 master kept as the bits its bf16 parameter lacks (swap_core.master_weights.remainder): exact for all 2^32
fp32 patterns, and why 16 bits alone would not be."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swap_core.master_weights.remainder import (
    MasterRemainder,
    has_remainder_form,
    join_master,
    remainder_nbytes,
    split_master,
)

CHUNK = 1 << 24
SLICES = 16
"""The 2^32 patterns in 16 slices of 16 chunks each, so that test workers share them."""


@pytest.mark.parametrize("part", range(SLICES))
def test_every_fp32_pattern_is_rebuilt_from_its_bf16_cast_and_its_remainder(part: int) -> None:
    """Each fp32 bit pattern as a master: its bf16 cast (torch's, round to nearest even) and its remainder give it
    back bit for bit, infinities, zeros of both signs and subnormals included; a NaN gives back a NaN."""
    chunks = (1 << 32) // CHUNK // SLICES
    for chunk in range(part * chunks, (part + 1) * chunks):
        start = chunk * CHUNK - (1 << 31)
        bits = torch.arange(start, start + CHUNK, dtype=torch.int32)
        master = bits.view(torch.float32)
        param = master.to(torch.bfloat16)
        rebuilt = join_master(param, split_master(master, param))
        exact = (rebuilt.view(torch.int32) == bits) | (master.isnan() & rebuilt.isnan())
        assert bool(exact.all()), f"patterns from {start & 0xFFFFFFFF:#010x}: {int((~exact).sum())} not rebuilt"


def test_an_even_bf16_is_the_cast_of_65537_fp32_values_one_more_than_16_bits_tell_apart() -> None:
    """Why the carry bit: the fp32 values whose high half is an even bf16 ``p`` or the one below it round to ``p``
    65,537 times (a tie rounds to the even side), so the low half alone cannot say which high half a master had."""
    for even in (0x3F80, 0x0002, 0x7F7E, 0xC2C8):  # 1.0, a subnormal, a large finite value, -100
        below = torch.arange((even - 1) << 16, (even + 1) << 16, dtype=torch.int64).to(torch.int32)
        casts = below.view(torch.float32).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
        assert int((casts == even).sum()) == 65_537, hex(even)


@settings(max_examples=200, deadline=None)
@given(
    shape=st.sampled_from([(1,), (7,), (8,), (9,), (3, 5), (2, 3, 4), (1000,)]),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([1e-40, 1e-3, 1.0, 3e38]),
)
def test_masters_of_any_shape_are_rebuilt_and_their_remainders_take_2_125_bytes_a_parameter(
    shape: tuple[int, ...], seed: int, scale: float
) -> None:
    master = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    param = master.to(torch.bfloat16)
    remainder = split_master(master, param)
    assert remainder.low.numel() * 2 + remainder.carry.numel() == remainder_nbytes(master.numel())
    out = torch.empty_like(master)
    assert join_master(param, remainder, out=out) is out
    assert torch.equal(out.view(torch.int32), master.view(torch.int32))


def test_remainder_bytes_are_10_125_a_parameter_for_adamw_and_6_125_for_one_moment() -> None:
    """The issue's budget: AdamW with fp32 masters moves at most 10.25 bytes a parameter each way (2 fp32 moments),
    SGD with momentum or Muon at most 6.25 (one), where the fp32 master alone was 4."""
    numel = 8 * 1_000_003
    assert remainder_nbytes(numel) / numel == 2.125
    assert (remainder_nbytes(numel) + 8 * numel) / numel == 10.125
    assert (remainder_nbytes(numel) + 4 * numel) / numel == 6.125
    assert remainder_nbytes(9) == 18 + 2, "the carry bytes round up"


def test_only_bf16_parameters_have_the_remainder_form() -> None:
    assert has_remainder_form(torch.bfloat16)
    assert not has_remainder_form(torch.float16), "an fp16 cast is not a rounding of the master's high half"
    assert not has_remainder_form(torch.float32)


@pytest.mark.parametrize(
    ("master", "param", "message"),
    [
        (torch.zeros(4), torch.zeros(4, dtype=torch.float16), r"fp32 master and a bf16 parameter.*float16"),
        (torch.zeros(4), torch.zeros(5, dtype=torch.bfloat16), r"of its parameter's shape, got \(4,\) and \(5,\)"),
        (torch.zeros(4, 2).t(), torch.zeros(2, 4, dtype=torch.bfloat16), r"contiguous"),
    ],
    ids=["fp16", "shape", "strided"],
)
def test_what_cannot_be_split_is_refused_naming_it(master: torch.Tensor, param: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_master(master, param)


def test_a_parameter_in_another_memory_order_is_read_in_its_logical_order() -> None:
    """A transposed (non-contiguous) parameter: split and join read it element by element in logical order, as the
    contiguous master is laid out, so the master comes back bit for bit."""
    master = torch.randn(6, 4, generator=torch.Generator().manual_seed(3)) * 100
    param = master.to(torch.bfloat16).t().contiguous().t()
    assert not param.is_contiguous()
    assert torch.equal(join_master(param, split_master(master, param)).view(torch.int32), master.view(torch.int32))


def test_a_remainder_of_another_size_is_refused_before_anything_is_written() -> None:
    param = torch.ones(9, dtype=torch.bfloat16)
    remainder = MasterRemainder(torch.zeros(8, dtype=torch.int16), torch.zeros(1, dtype=torch.uint8))
    out = torch.full((9,), 5.0)
    with pytest.raises(ValueError, match=r"8 low halves and 1 carry bytes does not fit a parameter of 9 elements"):
        join_master(param, remainder, out=out)
    assert bool((out == 5.0).all())
