"""Every LR scheduler in ``torch.optim.lr_scheduler`` drives a swapped Adam exactly as a plain one.

The swapped optimizer shares ``param_groups`` with the wrapped one, so a
scheduler's writes (``lr``, and ``betas`` for the momentum-cycling schedulers)
reach every batch's update. Each scheduler runs on both optimizers with the same
gradients; lr (and betas) trajectories must be equal after every step, parameters
bitwise equal, and no warning may be emitted (warnings are errors here).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler

from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

Scheduler = lr_scheduler.LRScheduler
SchedulerFactory = Callable[[torch.optim.Optimizer], Scheduler]

STEPS = 14
SHAPES = ((40, 30), (90,), (25, 20), (7,))
PLATEAU_METRICS = (1.0, 0.9, 0.95, 0.97, 0.99, 1.0, 0.8, 0.85, 0.9, 0.9, 0.9, 0.7, 0.75, 0.8)


def _sequential(optimizer: torch.optim.Optimizer) -> Scheduler:
    warmup = lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    decay = lr_scheduler.ExponentialLR(optimizer, gamma=0.8)
    return lr_scheduler.SequentialLR(optimizer, schedulers=[warmup, decay], milestones=[4])


def _chained(optimizer: torch.optim.Optimizer) -> Scheduler:
    constant = lr_scheduler.ConstantLR(optimizer, factor=0.5, total_iters=3)
    decay = lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    return lr_scheduler.ChainedScheduler([constant, decay], optimizer=optimizer)


SCHEDULERS: dict[str, SchedulerFactory] = {
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lr_lambda=[lambda e: 0.9**e, lambda e: 1.0 / (1 + e)]),
    "MultiplicativeLR": lambda opt: lr_scheduler.MultiplicativeLR(opt, lr_lambda=lambda e: 0.95),
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "MultiStepLR": lambda opt: lr_scheduler.MultiStepLR(opt, milestones=[2, 5, 9], gamma=0.3),
    "ConstantLR": lambda opt: lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=4),
    "LinearLR": lambda opt: lr_scheduler.LinearLR(opt, start_factor=0.2, total_iters=5),
    "ExponentialLR": lambda opt: lr_scheduler.ExponentialLR(opt, gamma=0.9),
    "SequentialLR": _sequential,
    "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=6, eta_min=1e-4),
    "ChainedScheduler": _chained,
    "ReduceLROnPlateau": lambda opt: lr_scheduler.ReduceLROnPlateau(opt, patience=1, factor=0.5),
    "CyclicLR": lambda opt: lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=1e-2, step_size_up=3),
    "CyclicLR-no_momentum": lambda opt: lr_scheduler.CyclicLR(
        opt, base_lr=1e-3, max_lr=1e-2, step_size_up=2, mode="exp_range", gamma=0.9, cycle_momentum=False
    ),
    "CosineAnnealingWarmRestarts": lambda opt: lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=4, T_mult=2),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=[1e-2, 5e-3], total_steps=STEPS + 1),
    "PolynomialLR": lambda opt: lr_scheduler.PolynomialLR(opt, total_iters=8, power=2.0),
}
"""One factory per scheduler class; CyclicLR twice, cycling Adam's beta1 (the default) and not."""

MOMENTUM_CYCLING = ("CyclicLR", "OneCycleLR")
"""Schedulers that also write ``betas`` (beta1 plays momentum for Adam)."""


def _torch_scheduler_classes() -> set[str]:
    return {
        name
        for name in lr_scheduler.__all__
        if inspect.isclass(cls := getattr(lr_scheduler, name)) and issubclass(cls, Scheduler) and cls is not Scheduler
    }


def test_every_torch_scheduler_is_covered() -> None:
    covered = {name.split("-")[0] for name in SCHEDULERS}
    assert covered == _torch_scheduler_classes()


def _make_optimizer(backend: SimBackend | None) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    groups: list[dict[str, Any]] = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "amsgrad": True}]
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05)
    if backend is not None:
        optimizer = swap_optimizer(optimizer, SwapConfig(backend=backend, swap_times=3, min_numel=64))
    return params, optimizer


def _train(factory: SchedulerFactory, backend: SimBackend | None) -> tuple[list[torch.Tensor], list[Any], Any]:
    """Run the schedule; returns the parameters, the hyper-parameters after every step, and the state dict."""
    params, optimizer = _make_optimizer(backend)
    trajectory: list[Any] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler = factory(optimizer)
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(100 + step)
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator)
            optimizer.step()
            if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
                scheduler.step(PLATEAU_METRICS[step])
            else:
                scheduler.step()
            groups = optimizer.param_groups
            trajectory.append(([group["lr"] for group in groups], [group["betas"] for group in groups]))
            trajectory.append(scheduler.get_last_lr())
    return params, trajectory, optimizer.state_dict()


@pytest.mark.sim_only
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_drives_swapped_adam_exactly(name: str) -> None:
    expected_params, expected_trajectory, expected_state = _train(SCHEDULERS[name], None)
    params, trajectory, state = _train(SCHEDULERS[name], SimBackend(mode="random", seed=3))
    assert trajectory == expected_trajectory
    # The schedule really moved: a test of a constant lr would prove nothing.
    assert len({str(lrs) for lrs, _ in trajectory[::2]}) >= 2
    if name in MOMENTUM_CYCLING:
        assert len({str(betas) for _, betas in trajectory[::2]}) >= 2
    for index, (expected, actual) in enumerate(zip(expected_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"{name}: parameter {index}")
    assert_state_dicts_equal(expected_state, state, name)
