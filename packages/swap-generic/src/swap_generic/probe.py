"""A wrap-time check that an optimizer's step is per-parameter, on tiny stand-in parameters.

swap-generic runs the optimizer's step batch by batch, which is exact only if each parameter's update
reads its own gradient and state alone. An optimizer that couples parameters (a norm over the whole
group, a shared statistic) would be silently wrong batch by batch. :func:`coupling_of` steps a twin of
the optimizer (the same class and attributes, other param groups and state) over two small parameters
per group, once together and once one at a time, and compares the results bitwise.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from swap_core.torch_compat import step_hooks_silenced

from .group_values import GroupValues
from .torch_compat import unhooked_step

__all__ = ["PROBE_STEPS", "coupling_of"]

PROBE_STEPS = 3
"""Steps each stand-in takes (momentum-like couplings need more than one)."""

_SIZES = (4, 3, 2, 2, 2)
_OTHER_SIZES = (3, 5, 2, 2, 2)


def coupling_of(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer``'s step is not per-parameter, or ``None`` (per-parameter, or the probe cannot tell).

    Nothing of ``optimizer`` changes: the twin has its own param groups (copies of the group dicts over
    stand-ins) and its own state. A probe that raises tells nothing (the optimizer may need a state its
    constructor made, as Adagrad's): ``None``.
    """
    for index, group in enumerate(optimizer.param_groups):
        if not group["params"]:
            continue
        like = group["params"][0]  # a DTensor too: its device and dimensions are what the stand-ins need
        if not like.is_floating_point():
            continue
        try:
            together = _stepped(optimizer, index, like, apart=False)
            apart = _stepped(optimizer, index, like, apart=True)
        except Exception:  # the twin could not step: nothing can be told
            return None
        for position, (first, second) in enumerate(zip(together, apart, strict=True)):
            if not torch.equal(first.view(torch.uint8), second.view(torch.uint8)):
                return (
                    f"stepping two stand-in parameters of param group {index} together and one at a time gave "
                    f"different values (stand-in {position} after {PROBE_STEPS} steps)"
                )
    return None


def _stepped(optimizer: torch.optim.Optimizer, index: int, like: torch.Tensor, *, apart: bool) -> list[torch.Tensor]:
    """The two stand-ins of group ``index`` after :data:`PROBE_STEPS` steps of a twin of ``optimizer``."""
    generator = torch.Generator().manual_seed(1234)
    shapes = [tuple(sizes[: like.dim()]) for sizes in (_SIZES, _OTHER_SIZES)]
    # Meta tensors hold no values to compare (swap-bench's planner steps them): the stand-ins live on the CPU.
    device = torch.device("cpu") if like.is_meta else like.device
    standins = [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(device=device, dtype=torch.float32))
        for shape in shapes
    ]
    twin = object.__new__(type(optimizer))
    twin.__dict__.update(optimizer.__dict__)
    twin.param_groups = [
        {**group, "params": list(standins) if position == index else []}
        for position, group in enumerate(optimizer.param_groups)
    ]
    twin.state = defaultdict(dict)
    step = unhooked_step(twin)
    with step_hooks_silenced(twin), torch.no_grad():
        for _ in range(PROBE_STEPS):
            for standin in standins:
                standin.grad = torch.randn(standin.shape, generator=generator).to(device)
            if not apart:
                step()
                continue
            values = GroupValues(twin)
            target = twin.param_groups[index]
            for standin in standins:
                values.before_batch()
                target["params"] = [standin]
                step()
                values.after_batch(0)
            target["params"] = list(standins)
    return [standin.detach() for standin in standins]
