"""A Llama-style decoder to train, built from a :class:`~swap_bench.models.ModelShape`: what ``swap-bench
device-perf`` runs forward and backward between optimizer steps.

Its parameters are exactly :meth:`ModelShape.parameter_shapes` (names and shapes, in ``model.parameters()`` order,
as Hugging Face's ``LlamaForCausalLM`` has them), so the planner's models and this one swap the same bytes. What is
left out changes no parameter and little compute: rotary position embeddings (attention is causal
``scaled_dot_product_attention``, grouped-query heads shared with ``enable_gqa``) and any cache for generation. Each
block is activation-checkpointed when training (``checkpointed=True``): its inputs are kept and its inside
recomputed in the backward, so that the many tokens a backward long enough to hide a step's copies needs fit in the
device's memory; the backward then does the forward's work once more, as large training runs do.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .models import ModelShape

__all__ = ["Decoder", "token_batch"]

NORM_EPS = 1e-5
INIT_STD = 0.02


class Decoder(nn.Module):
    """``shape``'s decoder with its language-model head; :meth:`forward` returns the next-token loss."""

    def __init__(self, shape: ModelShape, *, checkpointed: bool = True) -> None:
        super().__init__()
        self.shape = shape
        self.model = _Body(shape, checkpointed=checkpointed)
        self.lm_head = None if shape.tie_word_embeddings else nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        for module in self.modules():  # as Hugging Face's Llama starts (initializer_range 0.02): moderate logits
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of each position's logits against the token after it (the last position against the
        first: the targets are ``tokens`` rolled by one, which costs no copy of the logits)."""
        hidden = self.model(tokens)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        targets = tokens.roll(-1, dims=1)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class _Body(nn.Module):
    def __init__(self, shape: ModelShape, *, checkpointed: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(_Block(shape) for _ in range(shape.num_hidden_layers))
        self.norm = nn.RMSNorm(shape.hidden_size, eps=NORM_EPS)
        self.checkpointed = checkpointed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(tokens)
        for block in self.layers:
            if self.checkpointed and torch.is_grad_enabled():
                hidden = cast(torch.Tensor, checkpoint(block, hidden, use_reentrant=False))
            else:
                hidden = block(hidden)
        return cast(torch.Tensor, self.norm(hidden))


class _Block(nn.Module):
    """Attention and the gated MLP, each behind an RMSNorm, on the residual stream (the parameter order of
    ``parameter_shapes``: attention, MLP, then the two norms)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.self_attn = _Attention(shape)
        self.mlp = _MLP(shape)
        self.input_layernorm = nn.RMSNorm(shape.hidden_size, eps=NORM_EPS)
        self.post_attention_layernorm = nn.RMSNorm(shape.hidden_size, eps=NORM_EPS)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden))
        return hidden + cast(torch.Tensor, self.mlp(self.post_attention_layernorm(hidden)))


class _Attention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        hidden, key_value = shape.hidden_size, shape.key_value_size
        self.heads, self.key_value_heads = shape.num_attention_heads, shape.num_key_value_heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, key_value, bias=False)
        self.v_proj = nn.Linear(hidden, key_value, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape
        query = self._heads(self.q_proj(hidden), self.heads)
        key = self._heads(self.k_proj(hidden), self.key_value_heads)
        value = self._heads(self.v_proj(hidden), self.key_value_heads)
        attended = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, enable_gqa=self.key_value_heads != self.heads
        )
        return cast(torch.Tensor, self.o_proj(attended.transpose(1, 2).reshape(batch, length, width)))

    @staticmethod
    def _heads(projected: torch.Tensor, heads: int) -> torch.Tensor:
        batch, length, width = projected.shape
        return projected.view(batch, length, heads, width // heads).transpose(1, 2)


class _MLP(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.down_proj(F.silu(self.gate_proj(hidden)) * self.up_proj(hidden)))


def token_batch(vocab_size: int, batch: int, length: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """``batch`` sequences of ``length`` random token ids below ``vocab_size`` on ``device`` (the same for a seed)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab_size, (batch, length), generator=generator).to(device)
