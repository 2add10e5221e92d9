"""split_muon_params on a small transformer: which parameters Muon gets, which AdamW gets, and why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swap_muon import assign_muon_params, split_muon_params

VOCAB, WIDTH, CONTEXT, LAYERS = 50, 16, 12, 2

BLOCK_MATRICES = ("self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight")
BLOCK_VECTORS = {
    "self_attn.in_proj_bias": "bias",
    "self_attn.out_proj.bias": "bias",
    "linear1.bias": "bias",
    "linear2.bias": "bias",
    "norm1.weight": "norm",
    "norm1.bias": "norm",
    "norm2.weight": "norm",
    "norm2.bias": "norm",
}


class TinyTransformer(nn.Module):
    """Token and position embeddings, encoder blocks, a final norm and an output head."""

    def __init__(self, head_name: str = "head", tied: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.pos_embedding = nn.Parameter(torch.zeros(CONTEXT, WIDTH))  # 2-D, yet not a hidden matrix
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, 2, 4 * WIDTH, dropout=0.0, batch_first=True) for _ in range(LAYERS)
        )
        self.final_norm = nn.LayerNorm(WIDTH)
        self.head_name = head_name
        self.add_module(head_name, nn.Linear(WIDTH, VOCAB, bias=False))
        if tied:
            self.get_submodule(head_name).weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.tok_embeddings(tokens) + self.pos_embedding[: tokens.shape[1]]
        for block in self.blocks:
            hidden = block(hidden)
        return self.get_submodule(self.head_name)(self.final_norm(hidden))  # type: ignore[no-any-return]


def reasons(model: nn.Module, **options: object) -> dict[str, tuple[str, str]]:
    return {item.name: (item.optimizer, item.reason) for item in assign_muon_params(model, **options)}  # type: ignore[arg-type]


def expected_reasons(head_name: str = "head") -> dict[str, tuple[str, str]]:
    expected = {"pos_embedding": ("adamw", "embedding"), "tok_embeddings.weight": ("adamw", "embedding")}
    for layer in range(LAYERS):
        for name in BLOCK_MATRICES:
            expected[f"blocks.{layer}.{name}"] = ("muon", "hidden matrix")
        for name, reason in BLOCK_VECTORS.items():
            expected[f"blocks.{layer}.{name}"] = ("adamw", reason)
    expected["final_norm.weight"] = ("adamw", "norm")
    expected["final_norm.bias"] = ("adamw", "norm")
    expected[f"{head_name}.weight"] = ("adamw", "head")
    return expected


def test_the_recipe_on_a_small_transformer() -> None:
    model = TinyTransformer()
    assert reasons(model) == expected_reasons()
    muon_params, adamw_params = split_muon_params(model)
    # Every parameter exactly once, each list in model.parameters() order.
    everything = list(model.parameters())
    assert [id(p) for p in muon_params] == [id(p) for p in everything if any(p is q for q in muon_params)]
    assert sorted(map(id, muon_params + adamw_params)) == sorted(map(id, everything))
    assert len(muon_params) == LAYERS * len(BLOCK_MATRICES)
    assert all(param.ndim == 2 for param in muon_params)


@pytest.mark.parametrize("head_name", ["lm_head", "output", "head"])
def test_head_is_found_by_its_module_name(head_name: str) -> None:
    assert reasons(TinyTransformer(head_name)) == expected_reasons(head_name)


def test_an_unnamed_head_is_the_last_linear_unless_that_rule_is_off() -> None:
    model = TinyTransformer(head_name="to_logits")
    assert reasons(model)["to_logits.weight"] == ("adamw", "head")
    without_rule = reasons(model, last_linear_is_head=False)
    assert without_rule["to_logits.weight"] == ("muon", "hidden matrix")
    assert {name: value for name, value in without_rule.items() if name != "to_logits.weight"} == {
        name: value for name, value in expected_reasons("to_logits").items() if name != "to_logits.weight"
    }


def test_a_head_tied_to_the_embedding_goes_to_adamw_once() -> None:
    model = TinyTransformer(head_name="to_logits", tied=True)
    assignments = assign_muon_params(model)
    shared = [item for item in assignments if item.param is model.tok_embeddings.weight]
    assert [(item.optimizer, item.reason) for item in shared] == [("adamw", "embedding")]
    # The tie names the head, so the last-Linear fallback stays off: the last block's FFN is still Muon.
    assert reasons(model)[f"blocks.{LAYERS - 1}.linear2.weight"] == ("muon", "hidden matrix")
    assert len(assignments) == len(list(model.parameters()))


def test_named_parameters_give_the_same_split_when_names_follow_the_conventions() -> None:
    model = TinyTransformer()
    from_names = {item.name: (item.optimizer, item.reason) for item in assign_muon_params(model.named_parameters())}
    assert from_names == expected_reasons()


def test_named_parameters_cannot_see_module_types() -> None:
    """``nn.Embedding`` under an unconventional name is only recognized when the module is given."""
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, VOCAB))
    assert reasons(model)["0.weight"] == ("adamw", "embedding")
    from_names = {item.name: item.optimizer for item in assign_muon_params(model.named_parameters())}
    assert from_names["0.weight"] == "muon"


def test_overrides_by_name() -> None:
    model = TinyTransformer()
    result = reasons(
        model,
        force_muon=lambda name: name == "head.weight",
        force_adamw=lambda name: name.startswith("blocks.0."),
    )
    assert result["head.weight"] == ("muon", "override")
    assert result["blocks.0.linear1.weight"] == ("adamw", "override")
    assert result["blocks.1.linear1.weight"] == ("muon", "hidden matrix")


def test_forcing_a_non_2d_param_into_muon_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"'final_norm.weight' of shape \(16,\).*only supports 2-D"):
        split_muon_params(TinyTransformer(), force_muon=lambda name: name.startswith("final_norm"))


def test_a_param_selected_by_both_overrides_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"'head\.weight' is selected by both force_muon and force_adamw"):
        split_muon_params(
            TinyTransformer(), force_muon=lambda name: name == "head.weight", force_adamw=lambda name: "head" in name
        )


def test_conv_kernels_and_other_non_2d_weights_go_to_adamw() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 8), nn.Linear(8, 4))
    assert reasons(model)["0.weight"] == ("adamw", "not 2-D")
    assert reasons(model)["2.weight"] == ("muon", "hidden matrix")
    assert reasons(model)["3.weight"] == ("adamw", "head")


def test_bad_input_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="named_parameters"):
        split_muon_params([torch.nn.Parameter(torch.ones(2, 2))])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="'w' is a list, not a tensor"):
        split_muon_params([("w", [1.0])])  # type: ignore[list-item]


def test_the_split_builds_muon_and_adamw_and_trains() -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    muon_params, adamw_params = split_muon_params(model)
    optimizers = [torch.optim.Muon(muon_params, lr=2e-2), torch.optim.AdamW(adamw_params, lr=3e-3)]
    tokens = torch.randint(0, VOCAB, (4, CONTEXT))
    before = [param.detach().clone() for param in model.parameters()]
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
    assert all(not torch.equal(old, new) for old, new in zip(before, model.parameters(), strict=True))
