"""Random numbers drawn in ``step`` or at state creation land on the parameters torch gives them (issue 44, item 3).

An SGLD-style optimizer adds ``torch.randn_like(p)`` noise to each parameter in its step; another draws each
parameter's initial state from the RNG. Each draw lands on the parameter torch's step gives it only when the
parameters update in torch's order. Before: small states kept on the device updated first (from the second step on),
and ``prefetch="backward"`` or ``step="in_backward"`` walked the batches last-first (from the first step on), so the
noise landed on other parameters. Now the probe finds the draws, the batches are walked in torch's parameter order
(the resident parameters in their place), and the modes whose walk cannot follow that order are refused at wrap time,
before anything changes.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.errors import UnsupportedOptimizerError
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal
from swap_generic.probe import probe_step

SHAPES = ((16, 20), (3,), (8, 8), (4, 2), (30, 12), (5,), (40,))
"""Swapped states (over ``min_numel``) and resident ones (under it) interleaved, as a model's biases are."""
MIN_NUMEL = 32


class _PerParameter(torch.optim.Optimizer):
    """A momentum SGD step, parameter by parameter in torch's order; subclasses say where they draw."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, self.state[param], group)
        return None

    def _update(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = self._first_momentum(param)
        state["momentum_buffer"].mul_(group["momentum"]).add_(param.grad)
        param.add_(state["momentum_buffer"], alpha=-group["lr"])

    def _first_momentum(self, param: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(param)


class NoisySGD(_PerParameter):
    """SGD with momentum plus Gaussian noise on each parameter (SGLD-style), drawn per parameter in its step, from
    the default generator or from ``generator``."""

    def __init__(self, params: Any, noise: float = 0.01, generator: torch.Generator | None = None) -> None:
        super().__init__(params, {"lr": 0.05, "momentum": 0.9, "noise": noise})
        self.generator = generator

    def _update(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        super()._update(param, state, group)
        if group["noise"]:
            noise = torch.randn(param.shape, generator=self.generator, dtype=param.dtype)
            param.add_(noise.to(param.device), alpha=group["noise"])


class NoiseInitialised(_PerParameter):
    """Momentum SGD whose momentum buffer starts as noise drawn from the default generator (no draw afterwards)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.05, "momentum": 0.9})

    def _first_momentum(self, param: torch.Tensor) -> torch.Tensor:
        return torch.randn_like(param) * 1e-2


OPTIMIZERS = {
    "noise_in_step": lambda params: NoisySGD(params),
    "noise_from_its_generator": lambda params: NoisySGD(params, generator=torch.Generator().manual_seed(11)),
    "noise_initialised_state": NoiseInitialised,
}

SCHEDULES = {
    "lazy": lambda: SimBackend(mode="lazy"),
    "sync": lambda: SimBackend(mode="sync"),
    "random_3": lambda: SimBackend(mode="random", seed=3),
    "random_8": lambda: SimBackend(mode="random", seed=8),
}


def _params(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _run(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, steps: range) -> None:
    """``steps`` steps from the global RNG seeded alike (the draws), with gradients of a generator of their own."""
    torch.manual_seed(1000 + steps.start)
    for step in steps:
        generator = torch.Generator().manual_seed(100 + step)
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


def _assert_as_twin(params: list[torch.Tensor], optimizer: Any, twin_params: list[torch.Tensor], twin: Any) -> None:
    for index, (expected, actual) in enumerate(zip(twin_params, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index}")
    assert_state_dicts_equal(twin.state_dict(), optimizer.state_dict(), "the state dict")


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_draws_land_where_torch_puts_them(name: str, schedule: str, packed: bool) -> None:
    twin_params, params = _params(), _params()
    twin = OPTIMIZERS[name](twin_params)
    config = SwapConfig(backend=SCHEDULES[schedule](), swap_times=3, min_numel=MIN_NUMEL, packed=packed)
    swapped = swap_optimizer(OPTIMIZERS[name](params), config)
    _run(twin_params, twin, range(4))
    _run(params, swapped, range(4))
    assert swapped.stats.resident_state_device_bytes > 0, "some states stay on the device"
    _assert_as_twin(params, swapped, twin_params, twin)


def test_draws_follow_torch_after_add_param_group_and_with_a_prefetch() -> None:
    """A group added later and an explicit ``prefetch()`` (batch 0's copy-in before ``step()``) keep torch's order."""
    twin_params, params = _params(), _params()
    twin = NoisySGD(twin_params)
    swapped = swap_optimizer(
        NoisySGD(params), SwapConfig(backend=SimBackend(mode="random", seed=4), swap_times=3, min_numel=MIN_NUMEL)
    )
    _run(twin_params, twin, range(2))
    _run(params, swapped, range(2))
    for some_params, optimizer in ((twin_params, twin), (params, swapped)):
        some_params.extend(torch.nn.Parameter(torch.ones(shape)) for shape in ((6,), (12, 12)))
        optimizer.add_param_group({"params": some_params[-2:], "noise": 0.02})
    _run(twin_params, twin, range(2, 4))
    swapped.prefetch()
    _run(params, swapped, range(2, 4))
    _assert_as_twin(params, swapped, twin_params, twin)


MODES = {
    "prefetch_backward": ({"prefetch": "backward"}, r"SwapConfig\(prefetch='backward'\)"),
    "step_in_backward": ({"step": "in_backward"}, r"SwapConfig\(step='in_backward'\)"),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_walk_out_of_torch_order_is_refused_before_anything_changes(name: str, mode: str) -> None:
    options, named_mode = MODES[mode]
    twin_params, params = _params(), _params()
    twin, optimizer = OPTIMIZERS[name](twin_params), OPTIMIZERS[name](params)
    _run(twin_params, twin, range(2))
    _run(params, optimizer, range(2))
    checkpoint = copy.deepcopy(optimizer.state_dict())
    rng = torch.get_rng_state()
    config = SwapConfig(backend=SimBackend(mode="lazy"), swap_times=3, min_numel=MIN_NUMEL, **options)
    message = (
        rf"{type(optimizer).__name__} cannot be swapped with {named_mode}: its step draws random numbers from .*"
        r"the last parameters first\. Nothing was changed\. Swap it with SwapConfig\(step='after_backward'"
    )
    with pytest.raises(UnsupportedOptimizerError, match=message):
        swap_optimizer(optimizer, config)
    assert torch.equal(rng, torch.get_rng_state()), "the wrap drew nothing from the global RNG"
    assert_state_dicts_equal(checkpoint, optimizer.state_dict(), "the refused optimizer's state dict")
    _run(twin_params, twin, range(2, 5))
    _run(params, optimizer, range(2, 5))
    _assert_as_twin(params, optimizer, twin_params, twin)


def test_the_probe_names_the_generator_that_advanced() -> None:
    params = _params()
    assert probe_step(torch.optim.SGD(params, lr=0.1, momentum=0.9)).draws_random is None
    assert probe_step(NoisySGD(params, noise=0.0)).draws_random is None
    in_step = probe_step(NoisySGD(params)).draws_random
    assert in_step is not None and "torch.get_rng_state()" in in_step
    own = probe_step(NoisySGD(params, generator=torch.Generator().manual_seed(1))).draws_random
    assert own is not None and "NoisySGD.generator" in own
    initialised = probe_step(NoiseInitialised(params)).draws_random
    assert initialised is not None and "torch.get_rng_state()" in initialised


def test_noise_switched_on_after_wrapping_is_refused_before_any_batch() -> None:
    """Wrapped without noise the resident states update first; noise switched on by a group option is probed again
    and refused before any batch, naming the switch; set back, the steps go on as the twin's."""
    twin_params, params = _params(), _params()
    twin = NoisySGD(twin_params, noise=0.0)
    swapped = swap_optimizer(
        NoisySGD(params, noise=0.0), SwapConfig(backend=SimBackend(mode="lazy"), swap_times=3, min_numel=MIN_NUMEL)
    )
    _run(twin_params, twin, range(2))
    _run(params, swapped, range(2))
    swapped.param_groups[0]["noise"] = 0.01
    before = [param.detach().clone() for param in params]
    checkpoint = copy.deepcopy(swapped.state_dict())
    with pytest.raises(UnsupportedOptimizerError, match=r"'noise' changed from 0\.0 to 0\.01.*draws random numbers"):
        _run(params, swapped, range(2, 3))
    for index, (expected, actual) in enumerate(zip(before, params, strict=True)):
        assert_bitwise_equal(expected, actual, f"parameter {index} after the refused step")
    assert_state_dicts_equal(checkpoint, swapped.state_dict(), "after the refused step")
    swapped.param_groups[0]["noise"] = 0.0
    _run(twin_params, twin, range(2, 4))
    _run(params, swapped, range(2, 4))
    _assert_as_twin(params, swapped, twin_params, twin)


def test_inside_the_backward_the_draws_of_a_plain_model_are_refused() -> None:
    """``step="in_backward"`` updates each batch as its gradients become final, the last parameters first: refused
    at wrap time for an optimizer that draws, whatever the model."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    config = SwapConfig(backend=SimBackend(mode="lazy"), swap_times=2, min_numel=8, step="in_backward")
    with pytest.raises(UnsupportedOptimizerError, match=r"NoisySGD cannot be swapped .*draws random numbers"):
        swap_optimizer(NoisySGD(model.parameters()), config)
    accepted: SwapOptimizer = swap_optimizer(NoisySGD(model.parameters(), noise=0.0), config)
    assert isinstance(accepted, SwapOptimizer)
