"""The small FSDP2 training run every swap-ckpt test checkpoints: models, optimizers, steps, snapshots."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.state_dict_saver import save
from torch.utils._pytree import tree_map, tree_map_only

from swap_ckpt import AppState, load_checkpoint
from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

IN_FEATURES = 16
HIDDEN = 64
LR = 1e-2


def build_layers(*, hidden: int = HIDDEN, extra_layer: bool = False, drop_last: bool = False) -> torch.nn.Sequential:
    """The reference model ``Linear(16, 64) -> ReLU -> Linear(64, 16)``, or a variant of another model."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(IN_FEATURES, hidden), torch.nn.ReLU()]
    if not drop_last:
        layers.append(torch.nn.Linear(hidden, IN_FEATURES))
    if extra_layer:
        layers.append(torch.nn.Linear(IN_FEATURES, IN_FEATURES))
    return torch.nn.Sequential(*layers)


def shard(model: torch.nn.Sequential, world_size: int, *, replicas: int = 1) -> torch.nn.Sequential:
    """FSDP2 over a 1-D CPU mesh, or HSDP over a 2-D ``(replicas, world_size // replicas)`` one.

    Every Linear is its own unit, then the root.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if replicas == 1:
        mesh = init_device_mesh("cpu", (world_size,))
    else:
        shape = (replicas, world_size // replicas)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def adamw(
    model: torch.nn.Module, *, swapped: bool, seed: int = 0, master_weights: bool = False
) -> torch.optim.Optimizer:
    """AdamW, swapped through a random-order simulated accelerator (the 16-element bias stays resident)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    if not swapped:
        return optimizer
    backend = SimBackend(mode="random", seed=seed)
    config = SwapConfig(backend=backend, swap_times=2, min_numel=32, master_weights=master_weights)
    return swap_optimizer(optimizer, config)


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    first_step: int,
    steps: int,
    rank: int,
    *,
    dtype: torch.dtype = torch.float32,
) -> None:
    """``steps`` steps whose inputs (in the model's ``dtype``) depend only on the step index and the rank."""
    for step in range(first_step, first_step + steps):
        backward(model, step, rank, dtype=dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def backward(model: torch.nn.Module, step: int, rank: int, *, dtype: torch.dtype = torch.float32) -> None:
    """The forward and backward of step ``step`` on ``rank``: its gradients in the parameters."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(8, IN_FEATURES, generator=generator).to(dtype)
    model(inputs).square().mean().backward()


def local_snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """FQN-keyed model and optimizer state of this rank as plain tensors (local shards), cloned."""
    model_state, optim_state = get_state_dict(model, optimizer)
    snapshot: dict[str, Any] = tree_map_only(
        torch.Tensor, _local_clone, {"model": dict(model_state), "optim": dict(optim_state)}
    )
    return snapshot


def full_snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """:func:`local_snapshot` with every DTensor gathered (``full_tensor()``): a collective, call it on all ranks."""
    model_state, optim_state = get_state_dict(model, optimizer)
    snapshot: dict[str, Any] = tree_map_only(
        torch.Tensor, _full_clone, {"model": dict(model_state), "optim": dict(optim_state)}
    )
    return snapshot


def gathered(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The full tensors of the ``local_snapshot``s of every rank of a 1-D mesh (Shard(0), even sizes: concatenation)."""

    def full(*shards: Any) -> Any:
        if isinstance(shards[0], torch.Tensor) and shards[0].dim() > 0:
            return torch.cat(shards)
        return shards[0]

    result: dict[str, Any] = tree_map(full, per_rank[0], *per_rank[1:])
    return result


def assert_snapshots_equal(expected: dict[str, Any], actual: dict[str, Any], context: str) -> None:
    """Same model FQNs with bitwise-equal tensors, and bitwise-equal optimizer state dicts."""
    assert list(expected["model"]) == list(actual["model"]), f"{context}: model FQNs differ"
    for fqn, tensor in expected["model"].items():
        assert_bitwise_equal(tensor, actual["model"][fqn], f"{context}: model {fqn}")
    assert_state_dicts_equal(expected["optim"], actual["optim"], f"{context}: optimizer")


def check_interop_both_ways(
    build: Callable[[bool], tuple[torch.nn.Module, torch.optim.Optimizer]],
    rank: int,
    directory: Path,
    at_save: dict[str, Any],
    *,
    steps: int,
    options: StateDictOptions | None = None,
) -> None:
    """The swapped run's checkpoint (``directory/swapped``) loads into plain AdamW with ``at_save``'s values; a plain
    run of ``steps`` steps reaches ``at_save`` bitwise, and its checkpoint loads into swapped AdamW.

    ``build(swapped)`` makes the model and optimizer of the layout under test.
    """
    model, optimizer = build(False)
    load_checkpoint({"app": AppState(model, optimizer, options=options)}, directory / "swapped")
    assert_snapshots_equal(at_save, local_snapshot(model, optimizer), f"rank {rank} swapped -> plain")

    model, optimizer = build(False)
    train(model, optimizer, 0, steps, rank)
    plain_at_save = local_snapshot(model, optimizer)
    # Swapping is bitwise: the plain run reached the swapped run's state.
    assert_snapshots_equal(at_save, plain_at_save, f"rank {rank} plain vs swapped training")
    save({"app": AppState(model, optimizer, options=options)}, checkpoint_id=directory / "plain")

    model, optimizer = build(True)
    load_checkpoint({"app": AppState(model, optimizer, options=options)}, directory / "plain")
    assert_snapshots_equal(plain_at_save, local_snapshot(model, optimizer), f"rank {rank} plain -> swapped")


def _local_clone(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    local: torch.Tensor = to_local() if callable(to_local) else tensor
    return local.detach().clone()


def _full_clone(tensor: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)
    full: torch.Tensor = full_tensor() if callable(full_tensor) else tensor
    return full.detach().clone()
