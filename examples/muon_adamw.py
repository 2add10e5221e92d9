"""The Muon + AdamW recipe with both optimizers swapped: a tiny character-level causal transformer.

``split_muon_params`` sends the hidden weight matrices to ``torch.optim.Muon`` and the
embeddings, output head, norms and biases to ``torch.optim.AdamW``. Each optimizer is
wrapped with ``swap_optimizer``: Muon's ``momentum_buffer`` and AdamW's ``exp_avg`` /
``exp_avg_sq`` live in host memory between steps and stream through the device during
``step()``. swap-muon and swap-adam register their adapters through the
``swap_core.adapters`` entry point, so installing both packages is the only set-up:

    pip install -e packages/swap-core -e packages/swap-muon -e packages/swap-adam
    python examples/muon_adamw.py                  # sim, or the real accelerator when present
    python examples/muon_adamw.py --steps 200 --backend sim

Without an accelerator it runs on swap's simulated accelerator, which checks every copy
for races and counts device bytes exactly; both optimizers share one simulated device.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from swap_core import DeviceBackend, SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.errors import AdapterNotFoundError
from swap_core.sim import SimBackend
from swap_muon import split_muon_params

BACKENDS = ("sim", "auto", "cuda", "npu", "xpu")
WIDTH, HEADS, LAYERS, CONTEXT, BATCH_SIZE = 48, 4, 2, 32, 16

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way. "
)


class CharTransformer(nn.Module):
    """Token and position embeddings, pre-norm causal blocks, a final norm and an ``lm_head``."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, WIDTH)
        self.pos_embeddings = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(LAYERS)
        )
        self.final_norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for block in self.blocks:
            hidden = block(hidden, src_mask=causal, is_causal=True)
        logits: torch.Tensor = self.lm_head(self.final_norm(hidden))
        return logits


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to run (default: 60)")
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


def make_backend(name: str) -> tuple[DeviceBackend | str, torch.device]:
    """The backend both optimizers share, and the device the model lives on."""
    if name == "sim":
        return SimBackend(), torch.device("cpu")
    if name == "auto":
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None:
            raise SystemExit("--backend auto needs an accelerator; none is available (try --backend sim)")
        return name, accelerator
    return name, torch.device(name)


def build_optimizers(model: nn.Module, backend: DeviceBackend | str) -> tuple[SwapOptimizer, SwapOptimizer]:
    muon_params, adamw_params = split_muon_params(model)
    muon = torch.optim.Muon(muon_params, lr=2e-2, momentum=0.95, weight_decay=0.01)
    adamw = torch.optim.AdamW(adamw_params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    config = SwapConfig(swap_times=4, backend=backend)
    try:
        return swap_optimizer(muon, config), swap_optimizer(adamw, config)
    except AdapterNotFoundError as error:
        raise SystemExit(f"{error}\nThis example swaps AdamW too: install swap-adam next to swap-muon.") from error


def random_windows(data: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - CONTEXT - 1, (BATCH_SIZE,), generator=generator)
    windows = torch.stack([data[start : start + CONTEXT + 1] for start in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def sample(model: nn.Module, prompt: torch.Tensor, length: int) -> torch.Tensor:
    tokens = prompt
    for _ in range(length):
        logits = model(tokens[:, -CONTEXT:])
        tokens = torch.cat([tokens, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return tokens


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    backend, device = make_backend(args.backend)
    alphabet = sorted(set(TEXT))
    data = torch.tensor([alphabet.index(char) for char in TEXT])
    model = CharTransformer(len(alphabet)).to(device)
    muon, adamw = build_optimizers(model, backend)
    generator = torch.Generator().manual_seed(0)

    print(f"backend={args.backend} device={device} parameters={sum(p.numel() for p in model.parameters())}")
    print(f"Muon: {sum(p.numel() for g in muon.param_groups for p in g['params'])} parameters (hidden matrices)")
    print(f"AdamW: {sum(p.numel() for g in adamw.param_groups for p in g['params'])} parameters (the rest)")
    print(
        f"{'step':>5}  {'loss':>8}  {'muon h2d B':>10}  {'adamw h2d B':>11}  {'muon peak B':>11}  {'adamw peak B':>12}"
    )
    for step in range(1, args.steps + 1):
        inputs, targets = random_windows(data, generator)
        logits = model(inputs.to(device))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.to(device).flatten())
        muon.zero_grad(set_to_none=True)
        adamw.zero_grad(set_to_none=True)
        loss.backward()
        muon.step()
        adamw.step()
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(
                f"{step:>5}  {loss.item():>8.4f}  {muon.stats.h2d_bytes:>10}  {adamw.stats.h2d_bytes:>11}  "
                f"{muon.stats.peak_state_device_bytes:>11}  {adamw.stats.peak_state_device_bytes:>12}"
            )

    model.eval()
    prompt = data[:CONTEXT].unsqueeze(0).to(device)
    generated = sample(model, prompt, 40)[0, CONTEXT:].tolist()
    print(f"sample after {args.steps} steps: {''.join(alphabet[index] for index in generated)!r}")
    resident = muon.stats.resident_state_device_bytes + adamw.stats.resident_state_device_bytes
    print(f"between steps the device holds {resident} bytes of optimizer state (states under min_numel stay there)")
    if isinstance(backend, SimBackend):
        print(f"simulated device: {len(backend.races)} races")


if __name__ == "__main__":
    main()
