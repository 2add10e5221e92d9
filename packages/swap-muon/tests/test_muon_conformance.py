"""swap-muon's conformance rows: torch.optim.Muon through swap-core's whole adapter suite.

Muon only takes 2-D parameters, so every row sets ``shapes`` (swap-core's default
shapes include 1-D ones). The matrices are small because Newton-Schulz runs five
iterations of three bf16 matrix products per parameter per step; ``(4, 8)`` stays
under the suite's ``min_numel=64`` and so keeps its momentum resident next to
swapped ones.
"""

import torch

from swap_core.testing.conformance import ConformanceCase, make_conformance_tests

MATRIX_SHAPES = ((32, 48), (48, 32), (4, 8), (24, 16), (16, 40))

CASES = [
    ConformanceCase(
        "muon_defaults",
        lambda groups: torch.optim.Muon(groups, lr=2e-2),
        shapes=MATRIX_SHAPES,
    ),
    ConformanceCase(
        "muon_groups_bf16",
        lambda groups: torch.optim.Muon(groups, lr=2e-2, nesterov=False, weight_decay=0.0),
        shapes=MATRIX_SHAPES,
        dtypes=(torch.float32, torch.bfloat16),
        group_options=(
            {"adjust_lr_fn": "match_rms_adamw", "momentum": 0.9, "ns_coefficients": (3.0, -3.2, 1.2), "eps": 1e-4},
            {"adjust_lr_fn": "original", "nesterov": True, "weight_decay": 0.1, "lr": 5e-3, "ns_steps": 3},
        ),
    ),
]

globals().update(make_conformance_tests(CASES))
