"""Model shapes for the planner: Llama-style decoders, and one rank's FSDP2 shard of them.

A :class:`ModelShape` holds what decides a decoder's parameter shapes (the fields of a Hugging Face
``config.json`` of the Llama family); :meth:`ModelShape.parameter_shapes` lists them in the order of
``model.parameters()``, and :func:`fsdp_shard_shape` gives the local shard FSDP2's ``fully_shard``
holds on one rank (dim 0 split in ``world`` chunks of ``ceil(dim0 / world)`` rows, as ``torch.chunk``
splits it; the last ranks hold fewer rows, or none).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

__all__ = ["MODELS", "ModelShape", "fsdp_shard_shape"]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder: embeddings, ``layers`` blocks (attention, gated MLP, two RMSNorms), norm, head."""

    name: str
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the gated MLP."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """Fewer than ``num_attention_heads`` for grouped-query attention."""
    vocab_size: int
    tie_word_embeddings: bool = False
    """One matrix for the token embeddings and the output head."""

    def __post_init__(self) -> None:
        for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{field} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"ModelShape.hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        kv_heads: object = self.num_key_value_heads
        if not isinstance(kv_heads, int) or not 1 <= kv_heads <= self.num_attention_heads:
            raise ValueError(
                f"ModelShape.num_key_value_heads must be in [1, num_attention_heads={self.num_attention_heads}], "
                f"got {self.num_key_value_heads!r}"
            )

    @classmethod
    def from_config_json(cls, path: str | Path) -> ModelShape:
        """Read a Hugging Face ``config.json`` of a Llama-style model (the fields of this class)."""
        config: object = json.loads(Path(path).read_text())
        if not isinstance(config, dict):
            raise ValueError(
                f"{path}: expected a JSON object (a Hugging Face config.json), got {type(config).__name__}"
            )
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [key for key in required if key not in config]
        if missing:
            raise ValueError(f"{path}: a Llama-style config.json needs {', '.join(missing)}")
        return cls(
            name=Path(path).stem if Path(path).name != "config.json" else Path(path).parent.name or "config",
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            vocab_size=config["vocab_size"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    @property
    def key_value_size(self) -> int:
        """Rows of the key and value projections: ``num_key_value_heads`` heads of ``hidden / heads``."""
        return self.num_key_value_heads * (self.hidden_size // self.num_attention_heads)

    def parameter_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of every parameter, in ``model.parameters()`` order (Hugging Face's names)."""
        hidden, kv, mlp = self.hidden_size, self.key_value_size, self.intermediate_size
        shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab_size, hidden))]
        for layer in range(self.num_hidden_layers):
            prefix = f"model.layers.{layer}"
            shapes += [
                (f"{prefix}.self_attn.q_proj.weight", (hidden, hidden)),
                (f"{prefix}.self_attn.k_proj.weight", (kv, hidden)),
                (f"{prefix}.self_attn.v_proj.weight", (kv, hidden)),
                (f"{prefix}.self_attn.o_proj.weight", (hidden, hidden)),
                (f"{prefix}.mlp.gate_proj.weight", (mlp, hidden)),
                (f"{prefix}.mlp.up_proj.weight", (mlp, hidden)),
                (f"{prefix}.mlp.down_proj.weight", (hidden, mlp)),
                (f"{prefix}.input_layernorm.weight", (hidden,)),
                (f"{prefix}.post_attention_layernorm.weight", (hidden,)),
            ]
        shapes.append(("model.norm.weight", (hidden,)))
        if not self.tie_word_embeddings:
            shapes.append(("lm_head.weight", (self.vocab_size, hidden)))
        return shapes

    @property
    def numel(self) -> int:
        """Parameters of the whole model."""
        return sum(math.prod(shape) for _, shape in self.parameter_shapes())


def fsdp_shard_shape(shape: tuple[int, ...], world: int, rank: int) -> tuple[int, ...]:
    """The local shard of a parameter of ``shape`` that FSDP2 (``Shard(0)``) gives ``rank`` of ``world``."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"Invalid FSDP2 shard: rank {rank} of world {world}")
    rows = -(-shape[0] // world)
    local_rows = max(0, min(rows, shape[0] - rank * rows))
    return (local_rows, *shape[1:])


MODELS: dict[str, ModelShape] = {
    # Meta's published configs (Hugging Face config.json of meta-llama/Llama-3.2-1B and Llama-2-7b/13b/70b-hf).
    "llama-1b": ModelShape("llama-1b", 2048, 8192, 16, 32, 8, 128256, tie_word_embeddings=True),
    "llama-7b": ModelShape("llama-7b", 4096, 11008, 32, 32, 32, 32000),
    "llama-13b": ModelShape("llama-13b", 5120, 13824, 40, 40, 40, 32000),
    "llama-70b": ModelShape("llama-70b", 8192, 28672, 80, 64, 8, 32000),
}
"""Llama 3.2 1B (1.24B parameters) and Llama 2 7B, 13B and 70B (6.74B, 13.0B, 69.0B)."""
