"""What the benchmark swaps: parameter sets and the optimizers that own them."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import torch

TensorSpecs = tuple[tuple[tuple[int, ...], torch.dtype], ...]
"""``(shape, dtype)`` of every parameter of a workload."""

__all__ = [
    "ADAMW_KWARGS",
    "OPTIMIZERS",
    "QUICK_WORKLOADS",
    "WORKLOADS",
    "AdamWKwargs",
    "OptimizerSpec",
    "Workload",
    "transformer_shapes",
]


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named parameter set: ``(shape, dtype)`` per parameter."""

    name: str
    tensors: TensorSpecs

    @property
    def numel(self) -> int:
        return sum(torch.Size(shape).numel() for shape, _ in self.tensors)

    def make_params(self, device: torch.device, seed: int = 0) -> list[torch.nn.Parameter]:
        generator = torch.Generator().manual_seed(seed)
        return [
            torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype=dtype, device=device))
            for shape, dtype in self.tensors
        ]

    def make_grads(self, params: Sequence[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return [torch.randn(p.shape, generator=generator).to(dtype=p.dtype, device=p.device) * 1e-2 for p in params]


def transformer_shapes(layers: int, width: int, vocab: int) -> TensorSpecs:
    """The parameter shapes of a small GPT-style decoder (embeddings, attention, MLP, norms, head)."""
    fp32 = torch.float32
    block = [
        ((3 * width, width), fp32),
        ((3 * width,), fp32),
        ((width, width), fp32),
        ((width,), fp32),
        ((4 * width, width), fp32),
        ((4 * width,), fp32),
        ((width, 4 * width), fp32),
        ((width,), fp32),
        ((width,), fp32),
        ((width,), fp32),
    ]
    return (((vocab, width), fp32), *(block * layers), ((width,), fp32), ((vocab, width), fp32))


def _uniform(count: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> TensorSpecs:
    return tuple((shape, dtype) for _ in range(count))


WORKLOADS: dict[str, Workload] = {
    "many_small": Workload("many_small", _uniform(1000, (64, 64))),
    "few_large": Workload("few_large", _uniform(16, (2048, 2048))),
    "mixed_bf16_fp32": Workload(
        "mixed_bf16_fp32", _uniform(64, (256, 256), torch.bfloat16) + _uniform(64, (256, 256), torch.float32)
    ),
    "transformer": Workload("transformer", transformer_shapes(layers=6, width=384, vocab=4096)),
}
"""Full-size workloads: 1,000 x 4,096 fp32, 16 x 4M fp32, mixed bf16/fp32, a small transformer."""

QUICK_WORKLOADS: dict[str, Workload] = {
    "many_small": Workload("many_small", _uniform(64, (32, 32))),
    "few_large": Workload("few_large", _uniform(4, (256, 256))),
    "mixed_bf16_fp32": Workload(
        "mixed_bf16_fp32", _uniform(8, (64, 64), torch.bfloat16) + _uniform(8, (64, 64), torch.float32)
    ),
    "transformer": Workload("transformer", transformer_shapes(layers=2, width=64, vocab=256)),
}
"""Tiny versions for ``--quick`` (CI smoke: schemas and exact counts, not timings)."""


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer family to benchmark; ``accepts`` filters the parameters it can own."""

    name: str
    build: Callable[..., torch.optim.Optimizer]
    """``build(params, **options)``: the optimizer over ``params``, ``options`` added to its hyperparameters
    (the planner asks for ``foreach=True``, what torch picks on a CUDA device)."""
    accepts: Callable[[torch.Tensor], bool] = lambda param: True


class AdamWKwargs(TypedDict):
    """AdamW's hyperparameters, spelled out so that every AdamW in a run (plain, swapped, baselines) gets the same."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


ADAMW_KWARGS = AdamWKwargs(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
"""torch.optim.AdamW's defaults with ``lr=1e-3``; external baselines (DeepSpeedCPUAdam defaults to no weight decay) get
them explicitly."""

OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("adamw", lambda params, **options: torch.optim.AdamW(params, **ADAMW_KWARGS, **options)),
    "muon": OptimizerSpec(
        "muon", lambda params, **options: torch.optim.Muon(params, lr=1e-3, **options), accepts=lambda p: p.dim() == 2
    ),
    "rmsprop": OptimizerSpec("rmsprop", lambda params, **options: torch.optim.RMSprop(params, lr=1e-3, **options)),
    # Served by swap-generic (their own step, batch by batch); skipped rows, with the reason, without it.
    "sgd": OptimizerSpec("sgd", lambda params, **options: torch.optim.SGD(params, lr=1e-3, momentum=0.9, **options)),
    "adagrad": OptimizerSpec("adagrad", lambda params, **options: torch.optim.Adagrad(params, lr=1e-3, **options)),
    "nadam": OptimizerSpec("nadam", lambda params, **options: torch.optim.NAdam(params, lr=1e-3, **options)),
    # bitsandbytes, when installed (else a skipped row): uint8 states from 256 elements (its default is 4,096).
    "adamw8bit": OptimizerSpec("adamw8bit", lambda params, **options: _bitsandbytes_adamw8bit(params, **options)),
}


def _bitsandbytes_adamw8bit(params: Sequence[torch.Tensor], **options: Any) -> torch.optim.Optimizer:
    try:
        bitsandbytes_optim = importlib.import_module("bitsandbytes.optim")
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "bitsandbytes is not installed: adamw8bit rows need it (pip install bitsandbytes)", name=error.name
        ) from error
    optimizer: torch.optim.Optimizer = bitsandbytes_optim.AdamW8bit(params, lr=1e-3, min_8bit_size=256, **options)
    return optimizer
