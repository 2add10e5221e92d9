"""torch's own optimizer database as rows for swap's tests: every optimizer torch tests, with its test inputs.

``torch.testing._internal.common_optimizers.optim_db`` lists, per optimizer class, the constructor inputs
torch's own optimizer tests step, and which implementations (foreach, fused) each runs. Suites that hold
swapped optimizers to the plain ones over all of them take their rows from :func:`optim_db_configs`::

    CONFIGS = optim_db_configs(skip={"LBFGS", "SparseAdam"})

The database imports expecttest, a test-only package (``ModuleNotFoundError`` without it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from typing import Any

import torch

from ..torch_compat import optimizer_infos
from .pairs import ConformanceCase, make_groups, make_params, set_grads

__all__ = ["OptimDbConfig", "optim_db_configs", "plain_refusal"]


@dataclasses.dataclass(frozen=True)
class OptimDbConfig:
    """One optimizer class with one input of torch's database, in one implementation."""

    optimizer_cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]
    """The constructor's keyword arguments (the input's, and ``foreach=True`` or ``fused=True``)."""
    id: str
    """``Class-input_description-implementation``, a pytest id."""


def optim_db_configs(*, skip: Container[str] = ()) -> list[OptimDbConfig]:
    """Every input torch's database gives each optimizer class (but those named in ``skip``) on the CPU, in each
    implementation torch offers there: the default, ``foreach`` and ``fused``."""
    configs = []
    for info in optimizer_infos():
        name = info.optim_cls.__name__
        if name in skip:
            continue
        impls: list[dict[str, Any]] = [{}]
        if "foreach" in info.supported_impls:
            impls.append({"foreach": True})
        if "fused" in info.supported_impls and "cpu" in info.supports_fused_on:
            impls.append({"fused": True})
        for optim_input in info.optim_inputs_func(device="cpu"):
            for impl in impls:
                label = "-".join(f"{key}={value}" for key, value in impl.items()) or "default_impl"
                identifier = f"{name}-{optim_input.desc}-{label}".replace(" ", "_")
                configs.append(OptimDbConfig(info.optim_cls, {**optim_input.kwargs, **impl}, identifier))
    return configs


def plain_refusal(case: ConformanceCase) -> str | None:
    """Why the plain optimizer of ``case`` refuses to step on the CPU (an option torch runs on CUDA only), or
    ``None`` when it steps."""
    params = make_params(case, torch.device("cpu"))
    try:
        optimizer = case.make_optimizer(make_groups(case, params))
        set_grads(case, params, 0)
        optimizer.step()
    except (RuntimeError, ValueError, TypeError) as error:
        return str(error)
    return None
