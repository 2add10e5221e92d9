"""Colocated RL: a trainer that shares its device with an inference engine between steps.

An RL loop alternates a training step with a rollout in which an inference engine (its weights and KV cache) takes
most of the device. The optimizer's states must be off the device for the rollout: RL frameworks offload them after
each step and reload them before the next, two blocking copies of every state byte around every rollout. A swapped
optimizer keeps them in host memory between steps already: there is nothing to offload, and the step streams them
through the device in batches while it updates, so the step's own device peak is a fraction of them too.

This example trains the same model with plain AdamW (offloaded and reloaded around each rollout, as a framework
would) and with AdamW swapped, on swap's simulated accelerator, and prints for each: the optimizer's device bytes
during the rollouts, the bytes moved outside ``step()`` and inside it, and the optimizer's device bytes at the step's
peak. The plain loop's offload and reload are counted, not run (its states are CPU tensors here); the swapped loop's
bytes are what the simulator and ``opt.stats`` measured. The two runs' parameters are compared bitwise.

    python examples/colocated_rl.py                  # 5 rounds
    python examples/colocated_rl.py --rounds 20
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch import nn

from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend

WIDTH, LAYERS, BATCH = 512, 8, 64


@dataclasses.dataclass
class LoopRecord:
    """What one loop's optimizer held and moved (the most over all rounds, and the sum of the moves)."""

    name: str
    bytes_during_rollout: int = 0
    """Optimizer state on the device while the rollout ran."""
    moved_outside_step: int = 0
    """Bytes copied between device and host outside ``step()``: the offload and the reload."""
    bytes_at_step_peak: int = 0
    """Optimizer state on the device at the step's peak."""
    moved_inside_step: int = 0
    """Bytes the step itself copied between device and host (a swapped step streams the states in and out)."""


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (AdamW's ``exp_avg`` and ``exp_avg_sq``; its scalar steps aside)."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, round_index: int) -> None:
    inputs = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(round_index))
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def offloaded_loop(rounds: int) -> tuple[LoopRecord, nn.Module]:
    """Plain AdamW; the framework moves every state to the host before each rollout and back after it."""
    record, model = LoopRecord("plain AdamW, offloaded and reloaded around each rollout"), build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for index in range(rounds):
        train_step(model, optimizer, index)
        record.bytes_at_step_peak = max(record.bytes_at_step_peak, state_bytes(optimizer))
        record.moved_outside_step += 2 * state_bytes(optimizer)  # offload before the rollout, reload after it
    return record, model


def swapped_loop(rounds: int) -> tuple[LoopRecord, nn.Module]:
    """The same AdamW swapped: between steps its states are in host memory already."""
    record, model = LoopRecord(f"AdamW swapped, SwapConfig(swap_times={LAYERS})"), build_model()
    sim = SimBackend()
    config = SwapConfig(backend=sim, swap_times=LAYERS)  # a batch holds whole parameters: one layer each
    optimizer = swap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    for index in range(rounds):
        train_step(model, optimizer, index)
        sim.synchronize()
        record.bytes_during_rollout = max(record.bytes_during_rollout, sim.memory_allocated())
        record.bytes_at_step_peak = max(record.bytes_at_step_peak, optimizer.stats.peak_state_device_bytes)
        record.moved_inside_step += optimizer.stats.h2d_bytes + optimizer.stats.d2h_bytes
    return record, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="training steps, each followed by a rollout (5)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    (plain, plain_model), (swapped, swapped_model) = offloaded_loop(args.rounds), swapped_loop(args.rounds)
    weights = sum(p.numel() * p.element_size() for p in plain_model.parameters())
    print(f"{args.rounds} rounds; trainer weights {weights:,} B; AdamW state {2 * weights:,} B")
    for record in (plain, swapped):
        print(
            f"{record.name}:\n"
            f"  optimizer state on the device during the rollouts: {record.bytes_during_rollout:,} B\n"
            f"  moved outside step() (offload + reload):          {record.moved_outside_step:,} B\n"
            f"  moved inside step(), overlapped with the update:  {record.moved_inside_step:,} B\n"
            f"  optimizer state on the device at the step's peak: {record.bytes_at_step_peak:,} B"
        )
    same = all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), swapped_model.parameters(), strict=True))
    print(f"parameters bitwise equal after {args.rounds} rounds: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
