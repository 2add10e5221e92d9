"""``swap-bench narrowing`` as a smoke test: the JSON schema and the bitwise check of the three paths, never timings."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from swap_bench import main
from swap_bench.narrowing import NarrowingConfig, measure_narrowing
from swap_bench.report import SCHEMA
from swap_bench.workloads import OptimizerSpec

pytestmark = pytest.mark.sim_only
pytest.importorskip("swap_generic")

FIELDS = {
    "optimizer", "optimizer_class", "batches", "params_per_batch", "numel", "repeats", "full_step_s", "split_step_s",
    "narrowed_step_s", "narrowing_per_batch_s", "splitting_per_batch_s", "added_per_batch_s", "bitwise_equal",
}  # fmt: skip


def test_quick_run_writes_rows_whose_three_paths_agree_bitwise(tmp_path: Path) -> None:
    path = tmp_path / "narrowing.json"
    argv = ["narrowing", "--quick", "--batches", "4", "--optimizers", "sgd", "nadam", "adamw8bit", "--json", str(path)]
    assert main(argv) == 0
    document: dict[str, Any] = json.loads(path.read_text())
    assert document["schema"] == SCHEMA == "swap-bench/9" and document["kind"] == "narrowing"
    assert document["rows"] == [] and document["modeled_rows"] == [] and document["comparisons"] == []
    assert document["config"]["batches"] == 4 and document["config"]["repeats"] == 3
    rows = {row["optimizer"]: row for row in document["narrowing_rows"]}
    expected = {"sgd", "nadam"} | ({"adamw8bit"} if importlib.util.find_spec("bitsandbytes") else set())
    assert set(rows) == expected
    if "adamw8bit" not in rows:
        [skipped] = document["skipped"]
        assert skipped["row"] == "narrowing adamw8bit" and "bitsandbytes is not installed" in skipped["reason"]
    for row in rows.values():
        assert set(row) == FIELDS
        assert row["bitwise_equal"] is True and row["batches"] == 4 and row["repeats"] == 3
        assert min(row["full_step_s"], row["split_step_s"], row["narrowed_step_s"]) > 0
    assert rows["sgd"]["optimizer_class"] == "SGD" and rows["nadam"]["optimizer_class"] == "NAdam"


def test_paths_that_compute_different_things_are_reported_unequal(tmp_path: Path) -> None:
    """The bitwise check can fail: here every optimizer built after the first gets another learning rate."""
    rates = itertools.count(1)
    spec = OptimizerSpec("drifting", lambda params, **options: torch.optim.SGD(params, lr=1e-3 * next(rates)))
    row = measure_narrowing(spec, NarrowingConfig(batches=2, warmup=1, repeats=1))
    assert row.bitwise_equal is False
