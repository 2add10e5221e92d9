"""Train a tiny transformer with FSDP2 and swapped optimizers; checkpoint with DCP, stop, resume in new processes.

Run under torchrun (gloo, CPU, the simulated accelerator)::

    python -m torch.distributed.run --standalone --nproc_per_node 2 train_fsdp_ckpt.py --phase first --dir DIR
    python -m torch.distributed.run --standalone --nproc_per_node 2 train_fsdp_ckpt.py --phase resume --dir DIR

``first`` trains steps 0-4 and saves ``DIR/checkpoint``, then, in the same processes, builds the
model and optimizers afresh and trains them through steps 0-9 without a checkpoint (the
uninterrupted run; one launch fewer than a phase of its own); ``resume`` loads the checkpoint in new
processes and trains steps 5-9. The gathered final parameters and optimizer state of the
uninterrupted run and of the resumed one go from rank 0 to ``DIR/uninterrupted.pt`` and
``DIR/resume.pt``.
``--optim adamw`` (default) swaps one AdamW; ``--optim muon-adamw`` swaps
owner-rank distributed Muon for the hidden matrices and AdamW for the rest.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._pytree import tree_map_only

import swap_ckpt
from swap_core import SwapConfig, swap_optimizer
from swap_core.distributed import initialized_process_group

VOCAB, WIDTH, HEADS, CONTEXT, BATCH_SIZE = 32, 16, 2, 8, 4
STEPS_BEFORE_SAVE, STEPS_AFTER_SAVE = 5, 5


class TinyTransformer(nn.Module):
    """Token embeddings, two encoder layers and a head: small enough for 2 CPU processes."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        logits: torch.Tensor = self.head(hidden)
        return logits


def build(world_size: int, optim: str) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    """The same initial model on every rank, FSDP2-sharded (each block a unit, then the root), swapped optimizers."""
    torch.manual_seed(0)
    model = TinyTransformer()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # min_numel=64: the matrices and embeddings swap; the 8-element norm and bias shards stay resident.
    config = SwapConfig(backend="sim", swap_times=2, min_numel=64)
    if optim == "adamw":
        return model, [swap_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01), config)]
    from swap_muon import DistributedMuonAdapter, split_muon_params

    hidden_matrices, others = split_muon_params(model)
    muon = swap_optimizer(torch.optim.Muon(hidden_matrices, lr=2e-2, momentum=0.95), config)
    adamw = swap_optimizer(torch.optim.AdamW(others, lr=3e-3, weight_decay=0.01), config)
    assert isinstance(muon.adapter, DistributedMuonAdapter)  # owner-rank Muon over the FSDP2 shards
    return model, [muon, adamw]


def train(model: nn.Module, optimizers: list[torch.optim.Optimizer], steps: range, rank: int) -> None:
    """Next-token prediction on random tokens that depend only on the step index and the rank."""
    for step in steps:
        generator = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, VOCAB, (BATCH_SIZE, CONTEXT + 1), generator=generator)
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    # The states really travel through the simulated accelerator (a swap that moved nothing would prove nothing).
    for optimizer in optimizers:
        stats = optimizer.stats  # type: ignore[attr-defined]
        assert stats.batches > 0 and stats.h2d_bytes == stats.d2h_bytes, stats
    assert sum(optimizer.stats.h2d_bytes for optimizer in optimizers) > 0  # type: ignore[attr-defined]


def save_gathered(model: nn.Module, optimizers: list[torch.optim.Optimizer], path: Path, rank: int) -> None:
    """Full (gathered) parameters and each optimizer's state, written by rank 0."""

    def full(tensor: torch.Tensor) -> torch.Tensor:
        full_tensor = getattr(tensor, "full_tensor", None)
        gathered: torch.Tensor = full_tensor() if callable(full_tensor) else tensor
        return gathered.detach().cpu().clone()

    model_state, _ = get_state_dict(model, optimizers)
    optim_states = [dict(get_state_dict(model, optimizer)[1]) for optimizer in optimizers]
    state: dict[str, Any] = tree_map_only(torch.Tensor, full, {"model": dict(model_state), "optim": optim_states})
    if rank == 0:
        torch.save(state, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--phase", choices=("first", "resume"), required=True)
    parser.add_argument("--dir", type=Path, required=True, help="checkpoint and result directory")
    parser.add_argument("--optim", choices=("adamw", "muon-adamw"), default="adamw", help="swapped optimizers")
    args = parser.parse_args()

    torch.set_num_threads(1)
    # The teardown every swap test uses: no process group (nor gloo thread) outlives it into interpreter exit.
    with initialized_process_group("gloo"):
        run_phase(args.phase, args.dir, args.optim)


def run_phase(phase: str, directory: Path, optim: str) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizers = build(world_size, optim)
    checkpoint = directory / "checkpoint"
    total = STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE
    if phase == "first":
        train(model, optimizers, range(STEPS_BEFORE_SAVE), rank)
        dcp.save({"app": swap_ckpt.AppState(model, optimizers)}, checkpoint_id=checkpoint)
        del model, optimizers  # the stopped run ends here; the uninterrupted one starts from scratch
        model, optimizers = build(world_size, optim)
        train(model, optimizers, range(total), rank)
        save_gathered(model, optimizers, directory / "uninterrupted.pt", rank)
        return
    swap_ckpt.load_checkpoint({"app": swap_ckpt.AppState(model, optimizers)}, checkpoint)
    train(model, optimizers, range(STEPS_BEFORE_SAVE, total), rank)
    save_gathered(model, optimizers, directory / "resume.pt", rank)


if __name__ == "__main__":
    main()
