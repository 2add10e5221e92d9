"""Split parameters into consecutive batches of balanced cost.

Batches are consecutive so that, in packed mode, a batch's states form one
contiguous range of each dtype's host buffer and move with one copy per dtype.
The split depends only on the costs, never on the rank or the clock, so every
rank of a distributed job walks the same batches in the same order.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

__all__ = ["partition_consecutive"]


def partition_consecutive(costs: Sequence[int], *, num_batches: int, max_batch_cost: int | None = None) -> list[range]:
    """Cut ``range(len(costs))`` into at most ``num_batches`` consecutive, non-empty, balanced ranges.

    With ``max_batch_cost`` more batches are used until no batch exceeds it; a
    single item costlier than the bound gets a batch of its own.
    """
    if num_batches < 1:
        raise ValueError(f"Invalid num_batches: {num_batches}")
    if any(cost < 0 for cost in costs):
        raise ValueError(f"Partition costs must be >= 0, got {list(costs)}")
    if not costs:
        return []
    batches = _balanced(costs, min(num_batches, len(costs)))
    if max_batch_cost is None:
        return batches
    count = len(batches)
    while count < len(costs) and any(_cost(costs, batch) > max_batch_cost for batch in batches):
        count += 1
        batches = _balanced(costs, count)
    return batches


def _cost(costs: Sequence[int], batch: range) -> int:
    return sum(costs[batch.start : batch.stop])


def _balanced(costs: Sequence[int], count: int) -> list[range]:
    prefix = list(itertools.accumulate(costs, initial=0))
    total = prefix[-1]
    cuts = [0]
    for index in range(1, count):
        target = total * index / count
        cut = bisect.bisect_left(prefix, target)
        if cut > 0 and target - prefix[cut - 1] <= prefix[min(cut, len(costs))] - target:
            cut -= 1
        # Keep every batch non-empty and leave room for the batches still to come.
        lowest = cuts[-1] + 1
        highest = len(costs) - (count - index)
        cuts.append(min(max(cut, lowest), highest))
    cuts.append(len(costs))
    return [range(start, stop) for start, stop in itertools.pairwise(cuts)]
