"""The small FSDP2 training run every swap-ckpt test checkpoints: models, optimizers, steps, snapshots, and the
layout rows (:class:`Layout`) whose train-save-resume run is written once here."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.state_dict_saver import save
from torch.utils._pytree import tree_map, tree_map_only

from swap_ckpt import AppState, load_checkpoint
from swap_core import SwapConfig, swap_optimizer
from swap_core.config import StepMode
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal, assert_state_dicts_equal

IN_FEATURES = 16
HIDDEN = 64
LR = 1e-2
FIRST, SECOND = 5, 5
"""Steps before the checkpoint, and after it (by the run that saved it, and by the one that resumes from it)."""

AfterStep = Callable[[torch.nn.Module, torch.optim.Optimizer, int], None]
"""Runs after each training step: ``after_step(model, optimizer, step)``."""
Save = Callable[[torch.nn.Module, torch.optim.Optimizer, Path], Callable[[], None] | None]
"""Saves a model and its optimizer to a checkpoint directory; returns what finishes the save (an async save's wait)
once the run went on, or ``None``."""
Loader = Callable[[dict[str, Any], Path], None]


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
    model: torch.nn.Module,
    *,
    swapped: bool,
    seed: int = 0,
    master_weights: bool = False,
    step: StepMode = "after_backward",
) -> torch.optim.Optimizer:
    """AdamW, swapped through a random-order simulated accelerator (the 16-element bias stays resident)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    if not swapped:
        return optimizer
    backend = SimBackend(mode="random", seed=seed)
    config = SwapConfig(backend=backend, swap_times=2, min_numel=32, master_weights=master_weights, step=step)
    return swap_optimizer(optimizer, config)


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    first_step: int,
    steps: int,
    rank: int,
    *,
    dtype: torch.dtype = torch.float32,
    after_step: AfterStep | None = None,
) -> None:
    """``steps`` steps whose inputs (in the model's ``dtype``) depend only on the step index and the rank;
    ``after_step(model, optimizer, step)`` runs after each."""
    for step in range(first_step, first_step + steps):
        backward(model, step, rank, dtype=dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(model, optimizer, step)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A row of the checkpoint tests: how the reference model is sharded, in which dtype, with or without master
    weights, and in which form its optimizer state dict is saved."""

    name: str
    world_size: int
    replicas: int = 1
    """``> 1``: HSDP over a ``(replicas, world_size // replicas)`` mesh."""
    dtype: torch.dtype = torch.float32
    master_weights: bool = False
    options: StateDictOptions | None = None
    """The state-dict options of every save and load (``None``: DCP's defaults)."""
    step: StepMode = "after_backward"
    """Where the swapped optimizer's batches update (``SwapConfig.step``)."""

    def build(
        self, rank: int, *, swapped: bool = True, world_size: int | None = None
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The model sharded over this layout's mesh (or FSDP2 over ``world_size`` ranks) and its AdamW, seeded
        by ``rank``; master weights only where swapped."""
        replicas = self.replicas if world_size is None else 1
        model = shard(build_layers().to(self.dtype), world_size or self.world_size, replicas=replicas)
        master_weights = self.master_weights and swapped
        return model, adamw(model, swapped=swapped, seed=rank, master_weights=master_weights, step=self.step)

    def app(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The state dict DCP saves and loads: one :class:`~swap_ckpt.AppState` in this layout's form."""
        return {"app": AppState(model, optimizer, options=self.options)}

    def train(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        first_step: int,
        steps: int,
        rank: int,
        after_step: AfterStep | None = None,
    ) -> None:
        """:func:`train` on inputs in this layout's dtype."""
        train(model, optimizer, first_step, steps, rank, dtype=self.dtype, after_step=after_step)


FLATTENED = StateDictOptions(flatten_optimizer_state_dict=True)
FSDP = Layout("fsdp", 2)
HSDP = Layout("hsdp", 4, replicas=2)
FSDP_FLATTENED = Layout("fsdp-flattened", 2, options=FLATTENED)
FSDP_MASTERS = Layout("fsdp-bf16-masters", 2, dtype=torch.bfloat16, master_weights=True)
HSDP_MASTERS = Layout("hsdp-bf16-masters", 4, replicas=2, dtype=torch.bfloat16, master_weights=True)
FSDP_MASTERS_IN_BACKWARD = Layout(
    "fsdp-bf16-masters-in-backward", 2, dtype=torch.bfloat16, master_weights=True, step="in_backward"
)


def train_save_and_record(
    layout: Layout, rank: int, directory: Path, *, save: Save | None = None, after_step: AfterStep | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """The first world's run of ``layout``: :data:`FIRST` steps, a DCP checkpoint in ``directory/swapped`` (by
    ``save``, when given), :data:`SECOND` more steps; its state at the save and at the end go to
    ``directory/expected_<rank>.pt``. Returns the model, the optimizer and the state at the save."""
    model, optimizer = layout.build(rank)
    layout.train(model, optimizer, 0, FIRST, rank, after_step)
    at_save = local_snapshot(model, optimizer)
    finish = None
    if save is None:
        dcp.save(layout.app(model, optimizer), checkpoint_id=directory / "swapped")
    else:
        finish = save(model, optimizer, directory / "swapped")
    layout.train(model, optimizer, FIRST, SECOND, rank, after_step)
    if finish is not None:
        finish()
    torch.save({"at_save": at_save, "final": local_snapshot(model, optimizer)}, directory / f"expected_{rank}.pt")
    return model, optimizer, at_save


def resume_bitwise(
    layout: Layout, rank: int, directory: Path, *, checkpoint: str = "swapped", loader: Loader = load_checkpoint
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The second world's run of ``layout``, new processes: a fresh model and optimizer load ``checkpoint``
    with ``loader`` and resume; bitwise the recorded run at the save and after :data:`SECOND` more steps."""
    expected = torch.load(directory / f"expected_{rank}.pt", weights_only=True)
    model, optimizer = layout.build(rank)
    loader(layout.app(model, optimizer), directory / checkpoint)
    name = f"rank {rank} {layout.name} {checkpoint} ({loader.__name__})"
    assert_snapshots_equal(expected["at_save"], local_snapshot(model, optimizer), f"{name} load")
    layout.train(model, optimizer, FIRST, SECOND, rank)
    assert_snapshots_equal(expected["final"], local_snapshot(model, optimizer), f"{name} resume")
    return model, optimizer


def resharded_to_one_process(layout: Layout, directory: Path, state_key: str) -> None:
    """The checkpoint of ``layout`` (FSDP2, even shards) loads into the unsharded model in one process: the
    gathered values of every rank at the save; ``state_key`` of the first weight has its full shape."""
    per_rank = [torch.load(directory / f"expected_{rank}.pt", weights_only=True) for rank in range(layout.world_size)]
    model = build_layers().to(layout.dtype)
    optimizer = adamw(model, swapped=True, master_weights=layout.master_weights)
    load_checkpoint({"app": AppState(model, optimizer)}, directory / "swapped")
    at_save = gathered([run["at_save"] for run in per_rank])
    assert at_save["optim"]["state"]["0.weight"][state_key].shape == (HIDDEN, IN_FEATURES)
    assert_snapshots_equal(at_save, local_snapshot(model, optimizer), f"{layout.name} {layout.world_size} -> 1")


def resharded_to_more_ranks(layout: Layout, rank: int, world_size: int, directory: Path, state_key: str) -> None:
    """Run in a world of ``world_size`` ranks: the checkpoint of ``layout`` loads into FSDP2 over all of them,
    each rank its share of the gathered values at the save (``state_key`` of the first weight checked by shape)."""
    saved = range(layout.world_size)
    per_rank = [torch.load(directory / f"expected_{saved_rank}.pt", weights_only=True) for saved_rank in saved]
    model, optimizer = layout.build(rank, world_size=world_size)
    load_checkpoint({"app": AppState(model, optimizer)}, directory / "swapped")
    local_state = local_snapshot(model, optimizer)["optim"]["state"]["0.weight"][state_key]
    assert local_state.shape == (HIDDEN // world_size, IN_FEATURES), local_state.shape
    at_save = gathered([run["at_save"] for run in per_rank])
    context = f"rank {rank} {layout.name} {layout.world_size} -> {world_size}"
    assert_snapshots_equal(at_save, full_snapshot(model, optimizer), context)


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


def check_interop_both_ways(layout: Layout, rank: int, directory: Path, at_save: dict[str, Any]) -> None:
    """The swapped run's checkpoint (``directory/swapped``) loads into plain AdamW with ``at_save``'s values; a plain
    run of :data:`FIRST` steps reaches ``at_save`` bitwise, and its checkpoint loads into swapped AdamW."""
    model, optimizer = layout.build(rank, swapped=False)
    load_checkpoint(layout.app(model, optimizer), directory / "swapped")
    assert_snapshots_equal(at_save, local_snapshot(model, optimizer), f"rank {rank} swapped -> plain")

    model, optimizer = layout.build(rank, swapped=False)
    layout.train(model, optimizer, 0, FIRST, rank)
    plain_at_save = local_snapshot(model, optimizer)
    # Swapping is bitwise: the plain run reached the swapped run's state.
    assert_snapshots_equal(at_save, plain_at_save, f"rank {rank} plain vs swapped training")
    save(layout.app(model, optimizer), checkpoint_id=directory / "plain")

    model, optimizer = layout.build(rank)
    load_checkpoint(layout.app(model, optimizer), directory / "plain")
    assert_snapshots_equal(plain_at_save, local_snapshot(model, optimizer), f"rank {rank} plain -> swapped")


def _local_clone(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    local: torch.Tensor = to_local() if callable(to_local) else tensor
    return local.detach().clone()


def _full_clone(tensor: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)
    full: torch.Tensor = full_tensor() if callable(full_tensor) else tensor
    return full.detach().clone()
