"""swap-core's conformance suite over Adam and AdamW rows.

Each row runs the whole suite (parity in lazy, sync and 20 random simulator
schedules x packed/per-tensor x duplex, the SwapConfig option variants, exact
accounting, checkpoint round trips, fault injection at every batch and copy).
The rows cover the implementations (single-tensor, foreach, fused), amsgrad,
maximize, both weight decays, tensor lr, capturable (fused, the one capturable
path a CPU runs), per-group hyper-parameters and mixed fp32/bf16/fp16; the
broader option product runs in test_adam_sweep.py.
"""

from typing import Any

import pytest
import torch

from swap_core.testing.conformance import ConformanceCase, check_parity, make_conformance_tests

MIXED = (torch.float32, torch.bfloat16, torch.float16)

CASES = [
    ConformanceCase("adam", lambda groups: torch.optim.Adam(groups, lr=1e-2)),
    ConformanceCase(
        "adamw_amsgrad_maximize_groups_mixed",
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, amsgrad=True, maximize=True, weight_decay=0.1),
        dtypes=MIXED,
        group_options=({}, {"lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.0, "foreach": True}),
    ),
    ConformanceCase(
        "adam_fused_amsgrad_l2_mixed",
        lambda groups: torch.optim.Adam(groups, lr=1e-2, fused=True, amsgrad=True, weight_decay=0.1),
        dtypes=MIXED,
    ),
    ConformanceCase(
        "adamw_fused_capturable_tensor_lr",
        lambda groups: torch.optim.AdamW(groups, lr=torch.tensor(1e-2), fused=True, capturable=True, maximize=True),
    ),
    ConformanceCase(
        "adam_tensor_lr_l2_groups",
        lambda groups: torch.optim.Adam(groups, lr=torch.tensor(1e-2), weight_decay=0.05, eps=1e-6),
        group_options=({}, {"amsgrad": True, "maximize": True}, {"lr": 2e-3, "foreach": False}),
    ),
    ConformanceCase(
        "adam_foreach_amsgrad_bf16",
        lambda groups: torch.optim.Adam(groups, lr=1e-2, foreach=True, amsgrad=True, betas=(0.5, 0.9)),
        dtypes=(torch.bfloat16,),
    ),
]

globals().update(make_conformance_tests(CASES))

CAPTURABLE_CASES = [
    ConformanceCase(
        f"adam_capturable_{name}",
        lambda groups, options=options: torch.optim.Adam(groups, lr=1e-2, capturable=True, amsgrad=True, **options),
        dtypes=MIXED,
    )
    for name, options in (("single", {"foreach": False}), ("foreach", {"foreach": True}), ("default", {}))
]


@pytest.mark.parametrize("case", CAPTURABLE_CASES, ids=str)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_tensor"])
def test_capturable_parity_on_an_accelerator(
    case: ConformanceCase, packed: bool, backend_name: str, swap_backend_factory: Any
) -> None:
    """capturable=True is supported: its step counters stay on the device beside the parameters.

    torch runs capturable single-tensor and foreach Adam only on accelerators (on CPU parameters
    it raises, swapped or not: see test_adam_bad_input.py), so this runs with --backend cuda|npu.
    The fused capturable path, which the CPU does run, is in the rows above.
    """
    if backend_name == "sim":
        pytest.skip("capturable single-tensor/foreach Adam needs an accelerator; run with --backend cuda|npu")
    check_parity(case, swap_backend_factory(mode="lazy"), packed=packed)
