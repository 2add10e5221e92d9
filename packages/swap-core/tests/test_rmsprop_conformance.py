"""swap-core's own conformance rows: RMSprop, the adapter swap-core ships."""

import torch

from swap_core.testing.conformance import ConformanceCase, make_conformance_tests

CASES = [
    ConformanceCase("rmsprop", lambda groups: torch.optim.RMSprop(groups, lr=1e-2)),
    ConformanceCase(
        "rmsprop_centered_momentum_groups",
        lambda groups: torch.optim.RMSprop(groups, lr=1e-2, momentum=0.9, centered=True, weight_decay=0.1),
        group_options=({}, {"lr": 3e-3, "maximize": True, "foreach": True}),
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
    ),
]

globals().update(make_conformance_tests(CASES))
