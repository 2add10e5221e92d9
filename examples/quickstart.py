"""Quickstart: train a small MLP while its RMSprop state lives in host memory between steps.

The optimizer is wrapped with one line, ``swap_optimizer(opt, SwapConfig(swap_times=4, ...))``;
every ``step()`` streams the state through the device in 4 batches and prints what moved.
Without an accelerator it runs on swap's simulated accelerator (``backend="sim"``), which
checks every copy for races and counts device bytes exactly.

    python examples/quickstart.py                 # sim, or the real accelerator when present
    python examples/quickstart.py --steps 50 --backend sim
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from swap_core import SwapConfig, SwapStats, swap_optimizer

BACKENDS = ("sim", "auto", "cuda", "npu", "xpu")
FEATURES, HIDDEN, OUTPUTS, HIDDEN_LAYERS = 256, 256, 16, 7
SAMPLES, BATCH_SIZE = 2048, 128

COLUMNS = (
    ("step", 5),
    ("loss", 10),
    ("h2d_bytes", 11),
    ("d2h_bytes", 11),
    ("h2d_copies", 10),
    ("d2h_copies", 10),
    ("batches", 7),
    ("peak_state_device_bytes", 23),
    ("step_ms", 8),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps to run (default: 30)")
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="device backend; default: 'auto' when an accelerator is present, else 'sim'",
    )
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.backend is None:
        args.backend = "auto" if torch.accelerator.is_available() else "sim"
    return args


def training_device(backend: str) -> torch.device:
    """Where the model lives: the accelerator for real backends, CPU memory for the simulator."""
    if backend == "sim":
        return torch.device("cpu")
    if backend == "auto":
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None:
            raise SystemExit("--backend auto needs an accelerator; none is available (try --backend sim)")
        return accelerator
    return torch.device(backend)


def build_model() -> nn.Sequential:
    # About 530k parameters: the eight 256x256 weight matrices are large enough to be swapped, while the
    # biases fall under SwapConfig.min_numel and stay resident on the device.
    layers: list[nn.Module] = [nn.Linear(FEATURES, HIDDEN), nn.GELU()]
    for _ in range(HIDDEN_LAYERS):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.GELU()]
    layers.append(nn.Linear(HIDDEN, OUTPUTS))
    return nn.Sequential(*layers)


def synthetic_regression(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of a noisy linear map, so the loss visibly goes down."""
    inputs = torch.randn(SAMPLES, FEATURES)
    true_map = torch.randn(FEATURES, OUTPUTS) / FEATURES**0.5
    targets = inputs @ true_map + 0.01 * torch.randn(SAMPLES, OUTPUTS)
    return inputs.to(device), targets.to(device)


def print_header() -> None:
    print("  ".join(name.rjust(width) for name, width in COLUMNS))


def print_row(step: int, loss: float, stats: SwapStats) -> None:
    values = (
        str(step),
        f"{loss:.5f}",
        str(stats.h2d_bytes),
        str(stats.d2h_bytes),
        str(stats.h2d_copies),
        str(stats.d2h_copies),
        str(stats.batches),
        str(stats.peak_state_device_bytes),
        f"{1000 * stats.step_seconds:.2f}",
    )
    print("  ".join(value.rjust(width) for value, (_, width) in zip(values, COLUMNS, strict=True)))


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    device = training_device(args.backend)

    model = build_model().to(device)
    inputs, targets = synthetic_regression(device)
    loss_fn = nn.MSELoss()

    backend = args.backend
    opt = swap_optimizer(torch.optim.RMSprop(model.parameters(), lr=1e-3), SwapConfig(swap_times=4, backend=backend))

    parameters = sum(p.numel() for p in model.parameters())
    print(f"backend={backend} device={device} parameters={parameters} steps={args.steps} swap_times=4")
    print_header()
    peak_per_step = []
    for step in range(1, args.steps + 1):
        batch = torch.randint(0, SAMPLES, (BATCH_SIZE,), device=device)
        loss = loss_fn(model(inputs[batch]), targets[batch])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        print_row(step, loss.item(), opt.stats)
        peak_per_step.append(opt.stats.peak_state_device_bytes)

    # RMSprop's default state is one `square_avg` per parameter, the parameter's size.
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = max(peak_per_step)
    print(f"RMSprop state: {state_bytes} bytes; unswapped, all of it stays on the device between steps.")
    print(f"Swapped: at most {peak} bytes on the device during a step ({peak / state_bytes:.0%}),")
    print(f"and {opt.stats.resident_state_device_bytes} bytes (small states kept resident) between steps.")


if __name__ == "__main__":
    main()
