"""``swap-bench plan``: the verdict on one job, within 100 columns, its bytes checked against the simulator."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swap_bench.cli import main
from swap_bench.fit import DEFAULT_SWAP_TIMES, Job, activation_bytes, device_bytes, judge
from swap_bench.models import MODELS, ModelShape
from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend

pytestmark = pytest.mark.sim_only

ROOT = Path(__file__).resolve().parents[3]

TINY = ModelShape("tiny", 64, 176, 2, 4, 2, 256)
"""Two decoder layers, grouped keys (2 of 4 heads), a SwiGLU MLP of 176."""


def _printed(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    status = main(["plan", *argv])
    output = capsys.readouterr().out
    too_wide = [line for line in output.splitlines() if len(line) > 100]
    assert not too_wide and "…" not in output, output  # within 100 columns, no name cut
    return status, output


def test_llama_7b_and_70b_at_world_8_get_their_verdict_within_100_columns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On 80 GB devices with 1 TB of host a node: llama-7b fits (unswapped too); llama-70b's activations alone
    overflow the device without checkpointing; with it, it fits swapped and not unswapped, and the step inside the
    backward, faster, would need more than the node's host memory."""
    monkeypatch.setenv("COLUMNS", "100")
    node = ["--world", "8", "--ranks-per-node", "8", "--device-memory", "80GB", "--host-memory", "1TB"]
    status, output = _printed(capsys, ["--model", "llama-7b", *node, "--no-iterations"])
    assert status == 0 and "Fits (it fits unswapped too)" in output
    assert 'Use: SwapConfig(master_weights=True, step="in_backward")' in output
    status, output = _printed(capsys, ["--model", "llama-70b", *node, "--no-iterations"])
    assert status == 1 and "Does not fit" in output and "checkpoint activations" in output
    status, output = _printed(capsys, ["--model", "llama-70b", *node, "--activation-checkpointing"])
    assert status == 0 and "Fits (it does not fit unswapped)" in output
    assert "Use: SwapConfig(master_weights=True)" in output and "Stepping inside the backward would take" in output
    assert "step inside the backward" in output and "least possible" in output
    documented = (ROOT / "docs/benchmarks.md").read_text()
    for line in output.splitlines():
        assert line.rstrip() in documented, f"docs/benchmarks.md should show the verdict's line {line!r}"


@pytest.mark.filterwarnings("error")  # the planner's own batch counts above the parameters warn nothing
def test_the_verdict_follows_the_host_and_device_it_is_given() -> None:
    job = Job(MODELS["llama-70b"], 8, 8, 80 * 10**9, 10**12, True, 4096, True, "pcie5-achievable", iterations=False)
    verdict = judge(job)
    # Inside the backward (assumed faster without iterations) the second host copy would not fit the node.
    assert verdict.fits and verdict.mode == "after_backward"
    assert verdict.host_after < 10**12 < verdict.host_inside and verdict.host_bytes_per_node == verdict.host_after
    unchecked = judge(Job(**{**job.__dict__, "host_memory": None}))
    assert unchecked.mode == "in_backward" and unchecked.host_bytes_per_node == verdict.host_inside
    small_host = judge(Job(**{**job.__dict__, "host_memory": verdict.host_after - 1}))
    assert not small_host.fits and not small_host.fits_host and small_host.fits_device
    small_device = judge(Job(**{**job.__dict__, "device_memory": device_bytes(job).total + 10**9}))
    assert small_device.step is not None and small_device.step.batches > DEFAULT_SWAP_TIMES, "more batches to fit"
    assert small_device.fits_device


def test_weights_gradients_and_staging_are_exact_against_the_simulator() -> None:
    """A tiny model at world 1 stepped for real on the simulator (bf16 parameters, fp32 masters, AdamW,
    ``SwapConfig``'s default batches): its parameters' and gradients' bytes and the step's state peak are the
    verdict's."""
    job = Job(TINY, 1, 1, 10**9, None, True, 16, False, "pcie5-achievable", iterations=False)
    verdict = judge(job)
    assert verdict.step is not None and verdict.step.batches == DEFAULT_SWAP_TIMES
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for _, shape in TINY.parameter_shapes()]
    sim = SimBackend()
    optimizer = swap_optimizer(torch.optim.AdamW(params), SwapConfig(backend=sim, master_weights=True))
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    assert verdict.device.weights == sum(param.numel() * param.element_size() for param in params)
    grads = [param.grad for param in params if param.grad is not None]
    assert verdict.device.gradients == sum(grad.numel() * grad.element_size() for grad in grads)
    assert verdict.step.device_peak_state_bytes == optimizer.stats.peak_state_device_bytes > 0
    assert optimizer.stats.batches == verdict.step.batches


def test_the_activation_estimate_counts_what_each_layer_keeps() -> None:
    """``12 h + 2 kv + 4 i`` bf16 elements a token a layer, the layer inputs only when checkpointed (one layer
    recomputed at a time), and the head's inputs and fp32 logits and log-probabilities."""
    h, kv, i, vocab = 64, 32, 176, 256
    layer, head = 2 * (12 * h + 2 * kv + 4 * i), 2 * 2 * h + 8 * vocab
    assert activation_bytes(TINY, 10, checkpointing=False) == 10 * (2 * layer + head)
    assert activation_bytes(TINY, 10, checkpointing=True) == 10 * (2 * 2 * h + layer + head)


def _decoder_layer(x: torch.Tensor, weights: dict[str, torch.Tensor], heads: int) -> torch.Tensor:
    """A Llama decoder layer as Hugging Face writes it: RMSNorm, rotated queries and keys, fused attention, SwiGLU."""
    batch, tokens, hidden = x.shape
    head_dim = hidden // heads
    normed = torch.nn.functional.rms_norm(x, (hidden,), weights["norm1"])
    q, k, v = (
        (normed @ weights[name]).view(batch, tokens, heads, head_dim).transpose(1, 2) for name in ("q", "k", "v")
    )
    angles = torch.arange(tokens).unsqueeze(1) * torch.arange(head_dim // 2).unsqueeze(0) / head_dim
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(x.dtype) for f in (torch.cos, torch.sin))

    def rotated(t: torch.Tensor) -> torch.Tensor:
        half = torch.cat([-t[..., head_dim // 2 :], t[..., : head_dim // 2]], dim=-1)
        return t * cos + half * sin

    attended = torch.nn.functional.scaled_dot_product_attention(rotated(q), rotated(k), v, is_causal=True)
    x = x + attended.transpose(1, 2).reshape(batch, tokens, hidden) @ weights["o"]
    normed = torch.nn.functional.rms_norm(x, (hidden,), weights["norm2"])
    gated = torch.nn.functional.silu(normed @ weights["gate"]) * (normed @ weights["up"])
    return x + gated @ weights["down"]


def test_the_activation_estimate_is_what_a_llama_style_decoder_layer_keeps_for_its_backward() -> None:
    """The bytes autograd saves for a decoder layer's backward (bf16, fused attention on the CPU), counted once per
    storage and without the weights, are the estimate's ``2 (12 h + 2 kv + 4 i)`` a token, within 2 % (the norms'
    fp32 reciprocal roots, the attention's log-sum-exp and the rotation's tables are left out of it)."""
    model = ModelShape("decoder", 256, 688, 1, 4, 4, 256)
    h, i, tokens = model.hidden_size, model.intermediate_size, 2 * 128
    shapes = {"q": (h, h), "k": (h, h), "v": (h, h), "o": (h, h), "gate": (h, i), "up": (h, i), "down": (i, h)}
    weights = {name: torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for name, shape in shapes.items()}
    weights |= {name: torch.ones(h, dtype=torch.bfloat16, requires_grad=True) for name in ("norm1", "norm2")}
    kept: dict[int, int] = {}
    parameters = {weight.untyped_storage().data_ptr() for weight in weights.values()}

    def pack(saved: torch.Tensor) -> torch.Tensor:
        storage = saved.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return saved

    x = torch.randn(2, 128, h, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved):
        _decoder_layer(x, weights, model.num_attention_heads).sum().backward()
    layer = 2 * (12 * h + 2 * h + 4 * i) * tokens
    assert layer <= sum(kept.values()) <= 1.02 * layer, (sum(kept.values()), layer)
    head = tokens * (2 * 2 * h + 8 * model.vocab_size)
    assert activation_bytes(model, tokens, checkpointing=False) == layer + head
