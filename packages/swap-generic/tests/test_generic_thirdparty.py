"""Third-party per-parameter optimizers through the generic adapter (``nox -s thirdparty`` installs them).

Each test is skipped, with the reason, when its package is not installed; plain ``nox`` does not
install them. Every row: bitwise parity with the plain optimizer after every step in lazy and random
simulator schedules, packed and per-tensor, and checkpoint round trips with the plain optimizer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from swap_core.testing.conformance import ConformanceCase, check_checkpoint_round_trip, check_parity
from swap_core.testing.pairs import make_pair
from swap_core.testing.pytest_plugin import BackendFactory

MODES = (("lazy", 0), ("random", 1), ("random", 2))


def _lion(**options: Any) -> ConformanceCase:
    lion_pytorch = pytest.importorskip("lion_pytorch")
    return ConformanceCase(f"lion{options}", lambda groups: lion_pytorch.Lion(groups, lr=1e-3, **options))


def _schedule_free(name: str, *, train: bool = True, **options: Any) -> ConformanceCase:
    schedulefree = pytest.importorskip("schedulefree")

    def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        optimizer: torch.optim.Optimizer = getattr(schedulefree, name)(groups, **options)
        if train:
            optimizer.train()  # type: ignore[attr-defined]  # schedule-free steps only in train mode
        return optimizer

    return ConformanceCase(name, make)


def _hf_adafactor(**options: Any) -> ConformanceCase:
    optimization = pytest.importorskip("transformers.optimization")
    return ConformanceCase(f"hf_adafactor{options}", lambda groups: optimization.Adafactor(groups, **options))


CASES = {
    # Hugging Face's Adafactor: factored row/column statistics for matrices, a full one for vectors, an RMS scalar.
    "hf_adafactor_relative_step": lambda: _hf_adafactor(lr=None, relative_step=True, warmup_init=True),
    "hf_adafactor_fixed_lr": lambda: _hf_adafactor(lr=1e-3, relative_step=False, scale_parameter=False, beta1=0.9),
    "lion": lambda: _lion(weight_decay=0.1),
    "lion_decoupled": lambda: _lion(betas=(0.95, 0.98), weight_decay=0.1, decoupled_weight_decay=True),
    # Schedule-free writes k, weight_sum, lr_max and scheduled_lr into its param groups during step().
    "adamw_schedule_free": lambda: _schedule_free("AdamWScheduleFree", lr=1e-2, warmup_steps=3, weight_decay=0.01),
    "sgd_schedule_free": lambda: _schedule_free("SGDScheduleFree", lr=1e-2, warmup_steps=2),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_third_party_parity_and_checkpoints(name: str, packed: bool, swap_backend_factory: BackendFactory) -> None:
    case = CASES[name]()
    for mode, seed in MODES:
        check_parity(case, swap_backend_factory(mode=mode, seed=seed), packed=packed)
    check_checkpoint_round_trip(case, swap_backend_factory(mode="random", seed=7), packed=packed)


def test_schedule_free_train_and_eval_switching(swap_backend_factory: BackendFactory) -> None:
    """``eval()`` reads the swapped ``z`` from the wrapped optimizer: after ``synchronize()`` it is current."""
    pair = make_pair(_schedule_free("AdamWScheduleFree", lr=1e-2, warmup_steps=3), swap_backend_factory("random", 3))
    for _ in range(3):
        pair.step_both(2)
        pair.swapped.synchronize()  # eval() reads host mirrors directly
        for optimizer in (pair.reference, pair.swapped.optimizer):
            optimizer.eval()  # type: ignore[attr-defined]
        pair.assert_params_equal("in eval mode")
        for optimizer in (pair.reference, pair.swapped.optimizer):
            optimizer.train()  # type: ignore[attr-defined]
    pair.assert_equal("after switching train/eval three times")


@pytest.mark.parametrize("name", ["AdamWScheduleFree", "SGDScheduleFree"])
def test_schedule_free_wrapped_before_train(name: str, swap_backend_factory: BackendFactory) -> None:
    """Users build a schedule-free optimizer (in eval mode), wrap it, then call ``train()`` in their loop."""
    pair = make_pair(_schedule_free(name, train=False, lr=1e-2, warmup_steps=2), swap_backend_factory("random", 4))
    assert not pair.swapped.param_groups[0]["train_mode"], "wrapping left the optimizer in eval mode"
    pair.reference.train()  # type: ignore[attr-defined]
    pair.swapped.train()  # type: ignore[attr-defined]
    pair.step_both(4)
    pair.assert_equal("4 steps after train()")


BNB_SHAPES = ((128, 64), (64, 80), (8192,), (16,))
"""Parameters of at least 4,096 elements get 8-bit states (bitsandbytes' min_8bit_size); the last stays 32-bit."""


def _bnb(name: str, **options: Any) -> ConformanceCase:
    bnb = pytest.importorskip("bitsandbytes")
    optimizer_cls = getattr(bnb.optim, name)
    return ConformanceCase(name, lambda groups: optimizer_cls(groups, lr=1e-3, **options), shapes=BNB_SHAPES)


BNB_CASES = {
    "AdamW8bit": lambda: _bnb("AdamW8bit", weight_decay=0.01),
    "Lion8bit": lambda: _bnb("Lion8bit"),
    "AdamW32bit": lambda: _bnb("AdamW"),
}


@pytest.mark.parametrize("name", sorted(BNB_CASES))
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_bitsandbytes_parity_and_checkpoints(name: str, packed: bool, swap_backend_factory: BackendFactory) -> None:
    """bitsandbytes' own state_dict format (quantization state nested for FSDP) round-trips both ways."""
    case = BNB_CASES[name]()
    for mode, seed in MODES:
        check_parity(case, swap_backend_factory(mode=mode, seed=seed), packed=packed)
    check_checkpoint_round_trip(case, swap_backend_factory(mode="random", seed=7), packed=packed)


def test_bitsandbytes_8bit_codes_swap_as_uint8_with_exact_bytes(swap_backend_factory: BackendFactory) -> None:
    pair = make_pair(BNB_CASES["AdamW8bit"](), swap_backend_factory("lazy", 0), packed=False, min_numel=1024)
    pair.step_both(3)
    swapped = pair.swapped
    expected = 0
    for param in pair.swapped_params:
        state = swapped.state[param]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() >= 1024:
                expected += value.numel() * value.element_size()
                if param.numel() >= 4096 and key in ("state1", "state2"):
                    assert value.dtype == torch.uint8, f"{key} of a {tuple(param.shape)} parameter is {value.dtype}"
    assert expected > 0
    assert swapped.stats.host_state_bytes == expected
    assert swapped.stats.h2d_bytes == swapped.stats.d2h_bytes == expected
    pair.assert_equal("AdamW8bit after 3 steps")


def test_bitsandbytes_paged_and_overridden_optimizers_are_refused(swap_backend_factory: BackendFactory) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    from swap_core import SwapConfig, swap_optimizer
    from swap_core.errors import UnsupportedOptimizerError

    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(2)]
    config = SwapConfig(backend=swap_backend_factory("lazy", 0))
    with pytest.raises(UnsupportedOptimizerError, match="paged bitsandbytes optimizer"):
        swap_optimizer(bnb.optim.PagedAdamW8bit(params, lr=1e-3), config)
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.override_config(params[0], "optim_bits", 32)
    try:
        with pytest.raises(UnsupportedOptimizerError, match="put the overridden parameters in a param group"):
            swap_optimizer(bnb.optim.AdamW8bit(params, lr=1e-3), config)
    finally:
        manager.pid2config.clear()
        manager.index2config.clear()


TORCHAO_OPTIMIZERS = ("AdamW8bit", "AdamW4bit", "AdamWFp8")


@pytest.mark.parametrize("name", TORCHAO_OPTIMIZERS)
def test_torchao_low_bit_states_stay_resident_with_a_warning(name: str, backend_name: str) -> None:
    """torchao's low-bit states are tensor subclasses: they stay on the device, said once; the rest is exact.

    torchao steps through ``torch.compile``, which refuses to run under a ``TorchDispatchMode``: the
    simulator's race checker is off here (its other adversarial settings stay on).
    """
    if backend_name != "sim":
        pytest.skip("a simulator-only check (the race checker is switched off for torch.compile)")
    torchao_optim = pytest.importorskip("torchao.optim")
    from swap_core.sim import SimBackend

    optimizer_cls = getattr(torchao_optim, name)
    case = ConformanceCase(
        name, lambda groups: optimizer_cls(groups, lr=1e-3), shapes=((256, 256), (128, 256), (64,)), steps=3
    )
    with pytest.warns(UserWarning, match=rf"{name} keeps state 'exp_avg' in a \w+ \(a tensor subclass\)"):
        check_parity(case, SimBackend(mode="random", seed=1, check_races=False), packed=True)
