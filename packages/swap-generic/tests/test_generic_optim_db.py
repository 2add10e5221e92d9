"""Every torch.optim optimizer except LBFGS, swapped through the generic adapter over torch's own configurations.

The configurations are torch's ``OptimizerInfo`` database (``optim_db``, the one torch's optimizer tests
use), each with its default implementation and, where torch offers them on the CPU, foreach and fused.
Adam, AdamW, RMSprop and Muon are driven through the generic adapter too, as a cross-check of the
dedicated adapters (which have their own suites). Every run is bitwise equal to the plain optimizer
after every step, in lazy, sync and random simulator schedules, packed and per-tensor.

fp32 parameters only: torch 2.13's CPU fused SGD leaves the last elements of an fp16/bf16 momentum
buffer run-dependent (two plain runs disagree there), so reduced-precision rows live in
test_generic_conformance.py where two plain runs agree.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from swap_core.testing.conformance import ConformanceCase, check_parity
from swap_core.testing.optim_db import optim_db_configs, plain_refusal
from swap_core.testing.pairs import DEFAULT_SHAPES
from swap_core.testing.pytest_plugin import BackendFactory
from swap_generic import GenericAdapter

pytest.importorskip("expecttest", reason="torch's OptimizerInfo database needs expecttest")

MODES = (("lazy", 0), ("sync", 0), ("random", 0), ("random", 1))
MATRIX_SHAPES = ((48, 40), (40, 30), (33, 31), (8, 4), (64, 20))
NOT_SWEPT = {
    "LBFGS": "not per-parameter: refused (test_generic_behaviour.py)",
    "SparseAdam": "needs sparse gradients, which swapping refuses (test_generic_behaviour.py)",
}


CONFIGS = [
    pytest.param(config.optimizer_cls, config.kwargs, id=config.id) for config in optim_db_configs(skip=NOT_SWEPT)
]


def _case(optimizer_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> ConformanceCase:
    shapes = MATRIX_SHAPES if optimizer_cls.__name__ == "Muon" else DEFAULT_SHAPES  # Muon takes matrices only
    return ConformanceCase(
        f"{optimizer_cls.__name__}({kwargs})",
        lambda groups: optimizer_cls(groups, **kwargs),
        shapes=shapes,
        steps=6,
        adapter_factory=GenericAdapter,
    )


def test_the_sweep_covers_every_per_parameter_torch_optimizer() -> None:
    swept = {param.values[0].__name__ for param in CONFIGS}
    every = {config.optimizer_cls.__name__ for config in optim_db_configs()}
    assert swept == every - set(NOT_SWEPT), f"not swept: {sorted(every - swept - set(NOT_SWEPT))}"
    assert len(CONFIGS) >= 100, len(CONFIGS)


@pytest.mark.parametrize("optimizer_cls,kwargs", CONFIGS)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_optim_db_parity(
    optimizer_cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    packed: bool,
    swap_backend_factory: BackendFactory,
) -> None:
    case = _case(optimizer_cls, kwargs)
    refused = plain_refusal(case)
    if refused is not None:
        pytest.skip(f"the plain optimizer refuses it: {refused}")
    for mode, seed in MODES:
        check_parity(case, swap_backend_factory(mode=mode, seed=seed), packed=packed)
