import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swap_core.runtime.partition import partition_consecutive

costs_strategy = st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=60)


@given(costs=costs_strategy, batches=st.integers(min_value=1, max_value=20))
def test_batches_are_consecutive_non_empty_and_cover_everything(costs: list[int], batches: int) -> None:
    ranges = partition_consecutive(costs, num_batches=batches)
    assert len(ranges) == min(batches, len(costs))
    assert ranges[0].start == 0 and ranges[-1].stop == len(costs)
    for previous, current in itertools.pairwise(ranges):
        assert previous.stop == current.start
    assert all(len(span) > 0 for span in ranges)


@given(costs=costs_strategy, batches=st.integers(min_value=1, max_value=20))
def test_batches_are_balanced_within_one_item(costs: list[int], batches: int) -> None:
    ranges = partition_consecutive(costs, num_batches=batches)
    ideal = sum(costs) / len(ranges)
    largest_item = max(costs)
    for span in ranges:
        assert sum(costs[span.start : span.stop]) <= ideal + largest_item


@given(costs=costs_strategy, bound=st.integers(min_value=1, max_value=20_000))
def test_max_batch_cost_is_respected_when_items_fit(costs: list[int], bound: int) -> None:
    ranges = partition_consecutive(costs, num_batches=1, max_batch_cost=bound)
    for span in ranges:
        cost = sum(costs[span.start : span.stop])
        assert cost <= bound or len(span) == 1 or len(ranges) == len(costs)


def test_known_split() -> None:
    assert partition_consecutive([4, 4, 4, 4], num_batches=2) == [range(0, 2), range(2, 4)]
    assert partition_consecutive([10, 1, 1, 1, 1], num_batches=2) == [range(0, 1), range(1, 5)]
    assert partition_consecutive([5, 5, 5], num_batches=1, max_batch_cost=10) == [range(0, 1), range(1, 3)]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_batches: 0"):
        partition_consecutive([1], num_batches=0)
    with pytest.raises(ValueError, match=">= 0"):
        partition_consecutive([1, -1], num_batches=1)
    assert partition_consecutive([], num_batches=3) == []
