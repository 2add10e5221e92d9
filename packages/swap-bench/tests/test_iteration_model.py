"""The step inside the backward on the virtual clock: a llama-7b rank's iteration, forward start to forward start.

Deterministic (the virtual clock), so the goals are asserted: at world 8 on PCIe 5's achievable rates the swapped
iteration stays within 1.03 x the unswapped one at 4k tokens a rank, 1.05 x with master weights, 1.005 x at 64k.
Planted extra waits (updates held back to ``step()``; each copy-in behind the copy-out before it) break them.
Where the link cannot keep up (world 1 with master weights), the iteration is within 1.03 x of the transfers'
bound with three staging buffers (1.05 x with two); a copy-in held behind the copy-out two batches before it, as
with two, breaks that.
The table of docs/step-in-backward.md is what :func:`~swap_bench.iteration.model_iteration` gives today.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from swap_bench.iteration import IterationModel, IterationRow, documented_models, iteration_table, model_iteration
from swap_core.sim import LinkModel
from swap_core.testing import planted

pytestmark = [pytest.mark.sim_only, pytest.mark.figures]

ROOT = Path(__file__).resolve().parents[3]
(
    WORLD_8_4K,
    WORLD_8_4K_MASTERS,
    WORLD_8_64K,
    WORLD_8_4K_MASTERS_8_A_HOST,
    WORLD_1_MASTERS,
    WORLD_1_MASTERS_3_STAGED,
    WORLD_8_4K_NOT_BINDING,
    WORLD_8_4K_BINDING,
    WORLD_8_4K_MASTERS_NOT_BINDING,
    WORLD_8_4K_MASTERS_BINDING,
    WORLD_8_4K_MASTERS_55_PERCENT,
    WORLD_8_4K_MASTERS_55_PERCENT_3_STAGED,
    WORLD_8_4K_MASTERS_NIC,
) = documented_models()


def _inside_over_unswapped(spec: IterationModel) -> float:
    row = model_iteration(spec)
    return row.in_backward_seconds / row.unswapped_seconds


@pytest.mark.parametrize(
    ("spec", "goal"),
    [(WORLD_8_4K, 1.03), (WORLD_8_4K_MASTERS, 1.05), (WORLD_8_64K, 1.005)],
    ids=["world8-4k", "world8-4k-masters", "world8-64k"],
)
def test_the_iteration_inside_the_backward_is_within_the_goal_of_the_unswapped_one(
    spec: IterationModel, goal: float
) -> None:
    row = model_iteration(spec)
    assert row.in_backward_seconds <= goal * row.unswapped_seconds, row
    assert row.after_backward_seconds > goal * row.unswapped_seconds, "the goal is one the step after it misses"


def test_where_the_link_cannot_keep_up_three_staging_buffers_come_within_3_percent_of_the_transfers_bound() -> None:
    """World 1 with master weights: 81 GB each way. With two staging buffers a batch's copy-in waits for the
    copy-out of the batch two before it, which follows that batch's update: 1.045 x the bound, within 1.05 x but
    not 1.03 x. A third lets each copy-in run one batch further ahead (1.008 x), for one more batch of device
    memory."""
    two, three = model_iteration(WORLD_1_MASTERS), model_iteration(WORLD_1_MASTERS_3_STAGED)
    assert two.transfer_bound_seconds > two.unswapped_seconds, "the transfers bind"
    assert two.in_backward_seconds <= 1.05 * two.lower_bound_seconds, two
    assert two.in_backward_seconds > 1.03 * two.lower_bound_seconds, "two buffers miss the goal three meet"
    assert three.in_backward_seconds <= 1.03 * three.lower_bound_seconds, three
    four = model_iteration(dataclasses.replace(WORLD_1_MASTERS, staging_buffers=4))
    assert four.in_backward_seconds >= 0.999 * three.in_backward_seconds, "a fourth buffer gains nothing more"


def test_where_the_link_keeps_up_a_third_staging_buffer_changes_nothing() -> None:
    two = model_iteration(WORLD_8_4K_MASTERS)
    three = model_iteration(dataclasses.replace(WORLD_8_4K_MASTERS, staging_buffers=3))
    assert three.in_backward_seconds == pytest.approx(two.in_backward_seconds, rel=1e-3)


def test_three_buffers_with_each_copy_in_held_behind_the_copy_out_two_before_break_the_goal() -> None:
    """Planted: with three arenas, each copy-in also waits for the copy-out of the batch two before it (an extra
    wait, what two arenas need), so the third buffer buys nothing."""
    with planted.copy_ins_wait_for_the_copy_out(batches_before=2):
        row = model_iteration(WORLD_1_MASTERS_3_STAGED)
    assert row.in_backward_seconds > 1.03 * row.lower_bound_seconds, row


def test_an_update_held_back_to_step_breaks_the_goal() -> None:
    """Planted: no batch is ever ready inside the backward, so every update waits for its end."""
    with planted.updates_held_back_to_step():
        assert _inside_over_unswapped(WORLD_8_4K) > 1.03


def test_a_copy_in_held_behind_the_copy_out_before_it_breaks_the_goal() -> None:
    """Planted: each batch's copy-in waits for the copy-out of the batch before it (an extra wait in the arena
    walk), so the link never runs both ways at once."""
    with planted.copy_ins_issued_after_the_copy_out_before():
        assert _inside_over_unswapped(WORLD_8_4K_MASTERS) > 1.05


@pytest.mark.parametrize(
    ("clipped", "plain"),
    [(WORLD_8_4K_NOT_BINDING, WORLD_8_4K), (WORLD_8_4K_MASTERS_NOT_BINDING, WORLD_8_4K_MASTERS)],
    ids=["world8-4k", "world8-4k-masters"],
)
def test_a_clip_that_does_not_bind_costs_the_iteration_inside_the_backward_under_1_percent(
    clipped: IterationModel, plain: IterationModel
) -> None:
    """``clip_grad_norm_`` that never binds multiplies every gradient by exactly 1: each step commits, and the
    iteration costs only the clip itself more (its norms and its multiply on the compute stream)."""
    with_clip, without = model_iteration(clipped), model_iteration(plain)
    assert with_clip.in_backward_seconds <= 1.01 * without.in_backward_seconds, (with_clip, without)
    assert with_clip.in_backward_seconds > without.in_backward_seconds, "the clip itself is timed"


def test_a_clip_that_binds_at_every_step_costs_at_most_5_percent_over_the_step_after_the_backward() -> None:
    """Issue 43's goal, with master weights: every step begun inside the backward is taken back and runs again after
    it. The take-back leaves the parameters to the step running again, and the provisional walk holds its last
    copy-out until ``step()``, so that step starts once the updates are done, not once a copy nobody reads is.
    Held against the step after the backward over the same fp32 masters (inside the backward they stay fp32);
    after the backward with masters as remainders it is faster still (issue 46), which the docs say."""
    row = model_iteration(WORLD_8_4K_MASTERS_BINDING)
    fp32_masters = model_iteration(dataclasses.replace(WORLD_8_4K_MASTERS_BINDING, master_remainders=False))
    assert row.in_backward_seconds <= 1.05 * fp32_masters.after_backward_seconds, (row, fp32_masters)
    assert row.after_backward_seconds < fp32_masters.after_backward_seconds, "remainders move fewer bytes"


def test_a_provisional_copy_out_not_held_breaks_the_binding_clip_goal() -> None:
    """Planted: the last copy-out issued inside the backward, as any other."""
    with planted.provisional_copy_outs_not_held():
        row = model_iteration(WORLD_8_4K_MASTERS_BINDING)
    assert row.in_backward_seconds > 1.05 * row.after_backward_seconds, row


@pytest.mark.xfail(
    strict=True,
    reason="without master weights the step running again first copies the parameters back (their only copy "
    "before the step is the pinned one): 1.154 x the iteration stepping after the backward, beyond issue 43's goal "
    "(stated with master weights); see docs/step-in-backward.md",
)
def test_a_clip_that_binds_at_every_step_without_masters_costs_at_most_5_percent_more() -> None:
    row = model_iteration(WORLD_8_4K_BINDING)
    assert row.in_backward_seconds <= 1.05 * row.after_backward_seconds, row


def test_at_55_percent_of_the_peak_three_staging_buffers_bring_the_step_inside_the_backward_within_5_percent() -> None:
    """Issue 46's goal. At 55% of the peak the backward (203 ms) is shorter than the swap's transfers both ways
    (262.5 ms), so the copies must also run under the forward. With two staging buffers the prefetch after
    ``step()`` copies one batch in, and the walk spills into the step; with three, it copies two batches in."""
    two, three = model_iteration(WORLD_8_4K_MASTERS_55_PERCENT), model_iteration(WORLD_8_4K_MASTERS_55_PERCENT_3_STAGED)
    assert three.in_backward_seconds <= 1.05 * three.unswapped_seconds, three
    assert two.in_backward_seconds > 1.05 * two.unswapped_seconds, "two buffers miss the goal three meet"


def test_a_prefetch_of_one_batch_breaks_the_goal_at_55_percent_of_the_peak() -> None:
    """Planted: with three buffers, the prefetch after ``step()`` copies one batch in, as with two."""
    with planted.prefetch_of_one_batch():
        row = model_iteration(WORLD_8_4K_MASTERS_55_PERCENT_3_STAGED)
    assert row.in_backward_seconds > 1.05 * row.unswapped_seconds, row


def _ring_bytes_each_way(spec: IterationModel) -> int:
    """Two all-gathers and a reduce-scatter of every FSDP2 unit (the embedding, each decoder layer, the head), each
    moving (world - 1) / world of the unit's bf16 bytes in and as many out."""
    units: dict[str, int] = {}
    for name, shape in spec.model.parameter_shapes():
        unit = (
            ".".join(name.split(".")[:3])
            if name.startswith("model.layers.")
            else ("embed" if "embed" in name else "head")
        )
        units[unit] = units.get(unit, 0) + math.prod(shape) * 2
    return 3 * sum(nbytes * (spec.world - 1) // spec.world for nbytes in units.values())


def test_with_the_network_card_on_the_link_the_iteration_is_at_the_links_bound() -> None:
    """One rank a node, its network card behind the GPU's PCIe switch: FSDP2's collectives (35.4 GB each way an
    iteration at world 8 in bf16) share the link with the swap's 10.1 GB. The unswapped iteration is already bound
    by the collectives on the link; the swapped one inside the backward is within 1 % of the bound of both on it."""
    row = model_iteration(WORLD_8_4K_MASTERS_NIC)
    assert row.collective_bytes == _ring_bytes_each_way(WORLD_8_4K_MASTERS_NIC)
    link = LinkModel.preset(WORLD_8_4K_MASTERS_NIC.link)
    collectives_alone = link.concurrent_copy_seconds(0, 0, collective_nbytes=row.collective_bytes)
    assert row.unswapped_seconds >= collectives_alone > WORLD_8_4K_MASTERS_NIC.compute_seconds, row
    assert row.transfer_bound_seconds > row.unswapped_seconds, "the link, not the compute, is the limit"
    assert row.in_backward_seconds <= 1.01 * row.lower_bound_seconds, row
    without_card = model_iteration(dataclasses.replace(WORLD_8_4K_MASTERS_NIC, link="pcie5-achievable"))
    assert row.in_backward_seconds > without_card.in_backward_seconds, "the collectives are timed"


def test_the_table_of_the_step_in_backward_page() -> None:
    rows: list[IterationRow] = [model_iteration(spec) for spec in documented_models()]
    page = re.sub(r"[ \t]+", " ", (ROOT / "docs/step-in-backward.md").read_text())
    for line in iteration_table(rows).splitlines():
        assert re.sub(r"[ \t]+", " ", line) in page, f"docs/step-in-backward.md should have the row {line!r}"
