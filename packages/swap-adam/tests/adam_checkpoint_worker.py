"""Train Adam in this process, from scratch or from a checkpoint, and save checkpoints.

Run by test_adam_checkpoint.py in fresh interpreters, so that a checkpoint crosses
a process boundary exactly as it would between a training run and its resumption::

    python adam_checkpoint_worker.py save --steps 3 saved.pt
    python adam_checkpoint_worker.py resume --first-step 3 --steps 2 saved.pt resumed.pt

``save`` trains a plain and a swapped optimizer of every variant; ``resume`` loads the
swapped checkpoints into plain and swapped optimizers and the plain ones into swapped
optimizers, and continues. A checkpoint holds the parameters and ``optimizer.state_dict()``
per run; it is read with ``torch.load(weights_only=True)``. The functions are importable
so the test can compute the uninterrupted run in its own process.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend

SHAPES = ((40, 30), (90,), (25, 20), (7,), (64, 3))
DTYPES = (torch.float32, torch.bfloat16)


def _adamw_amsgrad_groups(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, amsgrad=True, weight_decay=0.1)


def _adam_fused_capturable_tensor_lr(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    # fused and capturable keep `step` beside the parameters, as float32: a different checkpoint layout.
    return torch.optim.Adam(params, lr=torch.tensor(1e-2), fused=True, capturable=True, maximize=True)


VARIANTS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "adamw_amsgrad_groups": _adamw_amsgrad_groups,
    "adam_fused_capturable_tensor_lr": _adam_fused_capturable_tensor_lr,
}
RESUMPTIONS = (("swapped", "plain"), ("plain", "swapped"), ("swapped", "swapped"))


def make_params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(DTYPES[index % len(DTYPES)]))
        for index, shape in enumerate(SHAPES)
    ]


def make_optimizer(variant: str, params: list[torch.Tensor], swapped: bool) -> torch.optim.Optimizer:
    optimizer = VARIANTS[variant](params)
    if swapped:
        return swap_optimizer(optimizer, SwapConfig(backend=SimBackend(mode="random", seed=2), swap_times=3))
    return optimizer


def train(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], first_step: int, steps: int) -> None:
    """Gradients depend only on the step index, so a resumed run sees the ones an uninterrupted run saw."""
    for step in range(first_step, first_step + steps):
        generator = torch.Generator().manual_seed(10_000 + step)
        for index, param in enumerate(params):
            skip = index == 0 and step % 4 == 3  # a parameter without a gradient now and then
            grad = torch.randn(param.shape, generator=generator).to(param.dtype)
            param.grad = None if skip else grad
        optimizer.step()


def checkpoint(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"params": [param.detach() for param in params], "optimizer": optimizer.state_dict()}


def resume(saved: dict[str, Any], variant: str, swapped: bool, first_step: int, steps: int) -> dict[str, Any]:
    """A fresh optimizer of kind ``swapped`` continues ``saved`` (a checkpoint of either kind)."""
    params = make_params()
    optimizer = make_optimizer(variant, params, swapped)
    with torch.no_grad():
        for param, value in zip(params, saved["params"], strict=True):
            param.copy_(value)
    optimizer.load_state_dict(saved["optimizer"])
    train(optimizer, params, first_step, steps)
    return checkpoint(params, optimizer)


def save_runs(steps: int) -> dict[str, dict[str, Any]]:
    """``{"plain" | "swapped": {variant: checkpoint after steps}}``."""
    runs: dict[str, dict[str, Any]] = {"plain": {}, "swapped": {}}
    for kind, variants in runs.items():
        for variant in VARIANTS:
            params = make_params()
            optimizer = make_optimizer(variant, params, swapped=kind == "swapped")
            train(optimizer, params, 0, steps)
            variants[variant] = checkpoint(params, optimizer)
    return runs


def resume_runs(path: str, first_step: int, steps: int) -> dict[str, dict[str, Any]]:
    """``{"<saved kind>_to_<loading kind>": {variant: checkpoint}}`` for swapped->plain, plain->swapped and
    swapped->swapped.

    Every resumption reads the file anew: a plain optimizer adopts loaded tensors that already have the
    parameter's dtype and device as they are, and updates them in place.
    """
    runs: dict[str, dict[str, Any]] = {}
    for source, target in RESUMPTIONS:
        runs[f"{source}_to_{target}"] = {
            variant: resume(
                torch.load(path, weights_only=True)[source][variant], variant, target == "swapped", first_step, steps
            )
            for variant in VARIANTS
        }
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    save = commands.add_parser("save", help="train plain and swapped optimizers from scratch and save them")
    save.add_argument("--steps", type=int, required=True)
    save.add_argument("output")
    resume = commands.add_parser("resume", help="load a 'save' checkpoint into fresh optimizers and continue")
    resume.add_argument("--first-step", type=int, required=True)
    resume.add_argument("--steps", type=int, required=True)
    resume.add_argument("checkpoint")
    resume.add_argument("output")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.command == "save":
        result = save_runs(args.steps)
    else:
        result = resume_runs(args.checkpoint, args.first_step, args.steps)
    torch.save(result, args.output)


if __name__ == "__main__":
    main()
