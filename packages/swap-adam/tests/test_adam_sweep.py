"""Bitwise parity over the full product of Adam/AdamW options, 20 steps each.

Options: optimizer (Adam, AdamW) x amsgrad x maximize x weight_decay (0, 0.1) x
implementation (torch's default choice, single-tensor, foreach, fused), plus Adam
with decoupled_weight_decay=True for every combination with weight decay (without
it, the flag changes nothing). Each combination runs 6 times: once for every
(swap_times 1/3/8) x (packed, per-tensor) pair, under the simulator's lazy, sync
or random schedule, so each combination sees every mode twice; the mode assigned to a
pair rotates from one combination to the next, so every (swap_times, layout, mode)
triple is covered many times over the sweep. Cheaper axes rotate too instead of
multiplying: the parameter dtypes (fp32, bf16, fp16, all three mixed), a tensor lr
(where torch allows one) and the random seed, so that all 20 seeds are used.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from swap_core.sim import SimBackend
from swap_core.testing.conformance import ConformanceCase, check_parity

OPTIMIZERS: dict[str, tuple[type[torch.optim.Adam], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {}),
    "adam_decoupled": (torch.optim.Adam, {"decoupled_weight_decay": True}),
    "adamw": (torch.optim.AdamW, {}),
}
IMPLEMENTATIONS: dict[str, dict[str, Any]] = {
    "default": {},  # foreach=None, fused=None: torch picks (single-tensor on CPU, foreach on accelerators)
    "single": {"foreach": False, "fused": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}
DTYPE_SETS: tuple[tuple[torch.dtype, ...], ...] = (
    (torch.float32,),
    (torch.bfloat16,),
    (torch.float16,),
    (torch.float32, torch.bfloat16, torch.float16),
)
# Small enough to sweep fast; (8,) and (40,) stay resident (the suite's min_numel is 64).
SHAPES = ((24, 20), (40,), (12, 11), (8,), (30, 7), (96,))
SWAP_TIMES = (1, 3, 8)
RANDOM_SEEDS = 20


MODES = ("lazy", "sync", "random")


def _combinations() -> list[tuple[int, str, bool, bool, float, str]]:
    product = itertools.product(OPTIMIZERS, (False, True), (False, True), (0.0, 0.1), IMPLEMENTATIONS)
    # decoupled_weight_decay only matters with weight decay.
    kept = [options for options in product if options[0] != "adam_decoupled" or options[3] != 0.0]
    return [(index, *options) for index, options in enumerate(kept)]


def _case(index: int, optimizer: str, amsgrad: bool, maximize: bool, weight_decay: float, implementation: str) -> Any:
    optimizer_cls, extra = OPTIMIZERS[optimizer]
    options = {**extra, **IMPLEMENTATIONS[implementation]}
    tensor_lr, dtypes = _rotated(index, implementation)

    def make_optimizer(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        lr: float | torch.Tensor = torch.tensor(1e-2) if tensor_lr else 1e-2
        return optimizer_cls(groups, lr=lr, amsgrad=amsgrad, maximize=maximize, weight_decay=weight_decay, **options)

    name = (
        f"{optimizer}-{implementation}-amsgrad={amsgrad}-maximize={maximize}-wd={weight_decay}"
        f"-{'tensor_lr' if tensor_lr else 'float_lr'}-{'_'.join(str(dtype)[6:] for dtype in dtypes)}"
    )
    return ConformanceCase(name, make_optimizer, shapes=SHAPES, dtypes=dtypes, steps=20)


def _rotated(index: int, implementation: str) -> tuple[bool, tuple[torch.dtype, ...]]:
    """Tensor lr (torch rejects it with foreach=True) and dtypes; periods 6 and 20 cross every option axis."""
    tensor_lr = (index // 3) % 2 == 1 and implementation != "foreach"
    return tensor_lr, DTYPE_SETS[(index // 5) % len(DTYPE_SETS)]


def _sweep() -> list[Any]:
    params = []
    for index, *options in _combinations():
        case = _case(index, *options)
        for layout, (swap_times, packed) in enumerate(itertools.product(SWAP_TIMES, (True, False))):
            mode = MODES[(layout + index) % len(MODES)]
            seed = (index * 2 + layout // len(MODES)) % RANDOM_SEEDS if mode == "random" else 0
            mode_id = f"{mode}{seed}" if mode == "random" else mode
            layout_id = f"k{swap_times}-{'packed' if packed else 'per_tensor'}"
            params.append(pytest.param(case, swap_times, packed, mode, seed, id=f"{case.name}-{layout_id}-{mode_id}"))
    return params


def test_sweep_covers_every_seed_and_every_layout_mode_triple() -> None:
    runs = [param.values for param in _sweep()]
    assert {seed for *_, mode, seed in runs if mode == "random"} == set(range(RANDOM_SEEDS))
    triples = {(swap_times, packed, mode) for _, swap_times, packed, mode, _ in runs}
    assert triples == set(itertools.product(SWAP_TIMES, (True, False), MODES))
    names = {case.name for case, *_ in runs}
    assert len(names) == len(_combinations()) == 80  # 2 x 2 x 2 x 2 x 4, plus 16 decoupled Adam


def test_rotated_axes_cross_every_option() -> None:
    """Every value of every option axis meets every dtype set and both lr kinds (foreach: float lr only)."""
    combinations = _combinations()
    rotated = [_rotated(index, options[-1]) for index, *options in combinations]
    for axis in range(1, 6):
        values = {combination[axis] for combination in combinations}
        with_dtypes = {
            (combination[axis], dtypes) for combination, (_, dtypes) in zip(combinations, rotated, strict=True)
        }
        assert with_dtypes == set(itertools.product(values, DTYPE_SETS)), f"axis {axis}"
        with_lr = {(combination[axis], lr) for combination, (lr, _) in zip(combinations, rotated, strict=True)}
        expected = {(value, lr) for value in values for lr in (False, True) if not (value == "foreach" and lr)}
        assert with_lr == expected, f"axis {axis}"


@pytest.mark.sim_only
@pytest.mark.parametrize("case,swap_times,packed,mode,seed", _sweep())
def test_option_sweep_parity(case: ConformanceCase, swap_times: int, packed: bool, mode: str, seed: int) -> None:
    check_parity(case, SimBackend(mode=mode, seed=seed), swap_times=swap_times, packed=packed)  # type: ignore[arg-type]
