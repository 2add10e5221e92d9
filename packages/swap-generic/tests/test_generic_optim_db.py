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

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from swap_core.testing.conformance import ConformanceCase, check_parity
from swap_core.testing.pairs import DEFAULT_SHAPES, make_groups, make_params, set_grads
from swap_core.testing.pytest_plugin import BackendFactory
from swap_generic import GenericAdapter

common_optimizers = pytest.importorskip(
    "torch.testing._internal.common_optimizers", reason="torch's OptimizerInfo database needs expecttest"
)

MODES = (("lazy", 0), ("sync", 0), ("random", 0), ("random", 1))
MATRIX_SHAPES = ((48, 40), (40, 30), (33, 31), (8, 4), (64, 20))
NOT_SWEPT = {
    "LBFGS": "not per-parameter: refused (test_generic_behaviour.py)",
    "SparseAdam": "needs sparse gradients, which swapping refuses (test_generic_behaviour.py)",
}


def _configs() -> Iterator[Any]:
    for info in common_optimizers.optim_db:
        name = info.optim_cls.__name__
        if name in NOT_SWEPT:
            continue
        impls: list[dict[str, Any]] = [{}]
        if "foreach" in info.supported_impls:
            impls.append({"foreach": True})
        if "fused" in info.supported_impls and "cpu" in info.supports_fused_on:
            impls.append({"fused": True})
        for optim_input in info.optim_inputs_func(device="cpu"):
            for impl in impls:
                kwargs = {**optim_input.kwargs, **impl}
                label = "-".join(f"{key}={value}" for key, value in impl.items()) or "default_impl"
                yield pytest.param(info.optim_cls, kwargs, id=f"{name}-{optim_input.desc}-{label}".replace(" ", "_"))


CONFIGS = list(_configs())


def _case(optimizer_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> ConformanceCase:
    shapes = MATRIX_SHAPES if optimizer_cls.__name__ == "Muon" else DEFAULT_SHAPES  # Muon takes matrices only
    return ConformanceCase(
        f"{optimizer_cls.__name__}({kwargs})",
        lambda groups: optimizer_cls(groups, **kwargs),
        shapes=shapes,
        steps=6,
        adapter_factory=GenericAdapter,
    )


def _plain_runs(case: ConformanceCase) -> str | None:
    """Why torch itself refuses this configuration on the CPU, or ``None`` if it runs."""
    params = make_params(case, torch.device("cpu"))
    try:
        optimizer = case.make_optimizer(make_groups(case, params))
        set_grads(case, params, 0)
        optimizer.step()
    except (RuntimeError, ValueError, TypeError) as error:
        return f"the plain optimizer refuses it: {error}"
    return None


def test_the_sweep_covers_every_per_parameter_torch_optimizer() -> None:
    swept = {param.values[0].__name__ for param in CONFIGS}
    every = {info.optim_cls.__name__ for info in common_optimizers.optim_db}
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
    refused = _plain_runs(case)
    if refused is not None:
        pytest.skip(refused)
    for mode, seed in MODES:
        check_parity(case, swap_backend_factory(mode=mode, seed=seed), packed=packed)
