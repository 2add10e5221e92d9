"""The fingerprints that tell an edited gradient (``step="in_backward"``): equal bits give equal fingerprints, one
changed element of any float type changes them, in any chunk; the watch tells replaced, edited, resized and re-set
gradients, whether or not torch moved their version counter."""

from __future__ import annotations

import pytest
import torch

from swap_core.optimizer.in_backward.gradient_fingerprint import CHUNK, ROW, fingerprint
from swap_core.optimizer.in_backward.gradient_watch import GradientWatch
from swap_core.sim import SimBackend

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn]


def _random(numel: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    return values.to(dtype) if not dtype.is_complex else torch.complex(values, -values).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_equal_bits_give_equal_fingerprints_and_one_changed_element_changes_them(dtype: torch.dtype) -> None:
    tensor = _random(1000, dtype)
    assert torch.equal(fingerprint(tensor), fingerprint(tensor.clone()))
    for position in (0, 517, 999):
        changed = tensor.clone()
        changed.view(torch.uint8)[position * tensor.element_size()] ^= 1  # the lowest bit of one element
        assert not torch.equal(fingerprint(tensor), fingerprint(changed)), (dtype, position)


@pytest.mark.parametrize(("dtype", "sums_in"), [(torch.bfloat16, torch.int32), (torch.float32, torch.int64)], ids=str)
def test_a_tensor_over_one_chunk_has_a_sum_per_row_and_a_change_shows_in_its_row_only(
    dtype: torch.dtype, sums_in: torch.dtype
) -> None:
    tensor = _random(CHUNK + ROW + 3, dtype)
    noted = fingerprint(tensor)
    assert noted.shape == (CHUNK // ROW + 2,) and noted.dtype == sums_in, "a sum a row; the last row, 3 long"
    for position, row in ((5, 0), (CHUNK + 7, CHUNK // ROW), (CHUNK + ROW + 2, CHUNK // ROW + 1)):
        changed = tensor.clone()
        changed[position] = changed[position] * 2 + 1
        differs = (fingerprint(changed) != noted).nonzero().flatten().tolist()
        assert differs == [row], (position, differs)


def test_the_most_negative_words_sum_exactly() -> None:
    """Every word at its most negative value: each row sum is that value times the sum of the row's weights (the
    fingerprint of words of 1), exactly: no wrap-around in either width."""
    for dtype, words in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32), (torch.float64, torch.int32)):
        count = 2 * ROW * (dtype.itemsize // words.itemsize)
        weights = int(fingerprint(torch.ones(count, dtype=words).view(dtype))[0])
        sums = fingerprint(torch.full((count,), torch.iinfo(words).min, dtype=words).view(dtype)).tolist()
        assert sums == [torch.iinfo(words).min * weights] * len(sums), (dtype, sums[:2])


def test_non_contiguous_and_empty_tensors_have_fingerprints() -> None:
    matrix = _random(64, torch.float32).reshape(8, 8)
    assert torch.equal(fingerprint(matrix.t()), fingerprint(matrix.t().contiguous()))
    assert fingerprint(torch.empty(0)).numel() == 0


def _param_with_grad() -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(16))
    param.grad = _random(16, torch.float32)
    return param


def test_the_watch_tells_edits_the_version_counter_misses() -> None:
    sim = SimBackend()
    edited, scaled_by_one, untouched, replaced = (_param_with_grad() for _ in range(4))
    watch = GradientWatch()
    for param in (edited, scaled_by_one, untouched, replaced):
        assert param.grad is not None
        watch.note(param, param.grad)
    assert edited.grad is not None and scaled_by_one.grad is not None and replaced.grad is not None
    version = edited.grad._version
    edited.grad.data.mul_(0.5)
    assert edited.grad._version == version, "torch does not count an edit through .data"
    scaled_by_one.grad.mul_(1.0)
    replaced.grad = replaced.grad.clone()
    assert watch.changed(sim.read_to_host) == [edited, replaced]


def test_the_watch_tells_resized_and_re_set_gradients_and_without_bits_only_replacement() -> None:
    sim = SimBackend()
    resized, dropped, unwatched_bits = (_param_with_grad() for _ in range(3))
    watch = GradientWatch()
    for param in (resized, dropped):
        assert param.grad is not None
        watch.note(param, param.grad)
    assert unwatched_bits.grad is not None
    watch.note(unwatched_bits, unwatched_bits.grad, bits=False)
    assert watch.drop(dropped) and dropped.grad is None and not watch.drop(dropped)
    assert watch.changed(sim.read_to_host) == []
    assert resized.grad is not None
    resized.grad.resize_(CHUNK + 1).zero_()
    dropped.grad = torch.zeros(16)
    unwatched_bits.grad.mul_(2.0)
    assert watch.changed(sim.read_to_host) == [resized, dropped]
