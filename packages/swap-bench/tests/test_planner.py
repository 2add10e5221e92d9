"""swap-bench plan: exact bytes of a real model's shard against hand computations; modeled seconds checked
against the bounds they must respect (deterministic virtual-clock times, never wall-clock)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from swap_bench.arguments import byte_size
from swap_bench.cli import main
from swap_bench.fake_world import fake_world
from swap_bench.iteration import IterationModel, model_iteration
from swap_bench.modeled import StepModel, model_step
from swap_bench.models import MODELS, ModelShape, fsdp_shard_shape
from swap_bench.planner import plan_model, recommend
from swap_bench.report import SCHEMA
from swap_bench.workloads import OPTIMIZERS, OptimizerSpec
from swap_core.backends.host_memory import MAX_HOST_BUFFER_BYTES
from swap_core.master_weights.remainder import remainder_nbytes
from swap_core.sim import LinkModel
from swap_core.testing import planted

PLAN = ["plan", "--tables"]
"""The planner's tables (``swap-bench plan`` alone prints the verdict: test_fit.py)."""

pytestmark = pytest.mark.sim_only

PCIE4 = LinkModel.preset("pcie4")


def _llama_70b_rank0_numel(world: int) -> int:
    """Llama 2 70B by hand: 8192 wide, 80 layers, MLP 28672, 8 key/value heads of 128, vocab 32000, untied."""

    def rows(n: int) -> int:
        return -(-n // world)

    layer = (
        rows(8192) * 8192  # q_proj
        + 2 * rows(1024) * 8192  # k_proj, v_proj
        + rows(8192) * 8192  # o_proj
        + 2 * rows(28672) * 8192  # gate_proj, up_proj
        + rows(8192) * 28672  # down_proj
        + 2 * rows(8192)  # the two RMSNorms
    )
    return 2 * rows(32000) * 8192 + 80 * layer + rows(8192)


def test_model_presets_have_their_published_sizes() -> None:
    assert MODELS["llama-1b"].numel == 1_235_814_400
    assert MODELS["llama-7b"].numel == 6_738_415_616
    assert MODELS["llama-13b"].numel == 13_015_864_320
    assert MODELS["llama-70b"].numel == 68_976_648_192
    assert MODELS["llama-70b"].numel == _llama_70b_rank0_numel(world=1)


def test_fsdp_shards_split_dim_0_as_torch_chunk_does() -> None:
    assert [fsdp_shard_shape((32000, 8), 3, rank) for rank in range(3)] == [(10667, 8), (10667, 8), (10666, 8)]
    assert [fsdp_shard_shape((5,), 4, rank) for rank in range(4)] == [(2,), (2,), (1,), (0,)]
    assert fsdp_shard_shape((7, 3, 2), 1, 0) == (7, 3, 2)
    with pytest.raises(ValueError, match="rank 4 of world 4"):
        fsdp_shard_shape((5,), 4, 4)


def test_llama_70b_at_world_8_with_master_weights_holds_the_hand_computed_bytes() -> None:
    """With fp32 masters (``master_remainders=False``) the bytes are 12 a parameter and the cold step stays within
    issue 14's 1.02 x its pipeline's bound; as remainders (the default, issue 46) 10.125 a parameter plus each
    shard's carry bytes rounded up, and the transfer is shorter, beyond the bound by the rebuild and split kernels
    of the masters, which the bound's plain update (T_c) does not run."""
    row = plan_model(
        MODELS["llama-70b"], "adamw", world=8, link="pcie4", swap_times=4, master_weights=True, master_remainders=False
    )
    params = _llama_70b_rank0_numel(world=8)
    assert row.params == params == 8_622_081_024
    # fp32 master + exp_avg + exp_avg_sq per bf16 parameter; every shard's bytes are a multiple of the
    # 64-byte slot alignment, so nothing is padded.
    assert row.host_state_bytes == row.host_pinned_bytes == 12 * params
    assert row.plain_state_device_bytes == 12 * params  # unswapped: masters and moments on the device
    assert row.h2d_bytes == row.d2h_bytes == 12 * params
    # One dtype, balanced batches: each batch's copy is cut at the middle of its arena, 2 per batch and direction,
    # and once more where it crosses the end of one of the 4 GiB chunks the host memory is pinned in.
    chunks = -(-12 * params // MAX_HOST_BUFFER_BYTES)
    assert row.batches == 4 and row.copies == 2 * (2 * 4 + chunks - 1) == 64
    # Two staging arenas of at most the largest batch, which holds at least a quarter of the bytes.
    largest_state = 12 * -(-32000 // 8) * 8192  # the embedding (and head) shard's master and moments
    assert 2 * 12 * params // 4 <= row.device_peak_state_bytes <= 2 * (12 * params // 4 + largest_state)
    # The link cannot move the bytes faster than its bandwidth; the pipeline stays near its bound.
    one_way = 12 * params / (PCIE4.h2d_gbps * 1e9)
    assert one_way < row.modeled_transfer_seconds <= 1.02 * row.bound_seconds  # issue 14's goal for a cold step
    assert row.modeled_step_seconds < row.modeled_transfer_seconds  # the last copy-out runs into the next forward
    assert row.link_utilization == pytest.approx(one_way / row.modeled_transfer_seconds)
    assert row.update_seconds > 0

    remainders = plan_model(MODELS["llama-70b"], "adamw", world=8, link="pcie4", swap_times=4, master_weights=True)
    shards = [fsdp_shard_shape(shape, 8, 0) for _, shape in MODELS["llama-70b"].parameter_shapes()]
    masters = sum(remainder_nbytes(math.prod(shape)) for shape in shards)
    assert remainders.h2d_bytes == remainders.d2h_bytes == 8 * params + masters  # no padding counted in copies
    assert remainders.h2d_bytes / params < 10.126
    assert remainders.plain_state_device_bytes == row.plain_state_device_bytes  # the unswapped reference: fp32
    assert remainders.modeled_transfer_seconds < 0.9 * row.modeled_transfer_seconds
    assert remainders.modeled_transfer_seconds <= 1.05 * remainders.bound_seconds


def test_plain_fp32_adamw_without_masters_and_determinism() -> None:
    first = plan_model(MODELS["llama-7b"], "adamw", world=8, link="pcie5", swap_times=8)
    params = sum(
        fsdp_shard_shape(shape, 8, 0)[0] * (shape[1] if len(shape) > 1 else 1)
        for _, shape in MODELS["llama-7b"].parameter_shapes()
    )
    assert first.params == params
    assert first.plain_state_device_bytes == 8 * params  # two fp32 moments
    # The 65 RMSNorm shards (512 elements) have fewer than SwapConfig.min_numel (1024): resident.
    resident = (2 * 32 + 1) * 4096 // 8
    assert first.host_state_bytes == first.h2d_bytes == 8 * (params - resident)
    # Each of 8 batches: 2 copies (cut at the arena's middle) per direction, one more where the 4 GiB chunk ends.
    assert first.copies == 2 * (2 * 8 + -(-8 * (params - resident) // MAX_HOST_BUFFER_BYTES) - 1) == 34
    assert plan_model(MODELS["llama-7b"], "adamw", world=8, link="pcie5", swap_times=8) == first


def test_planner_refuses_what_it_does_not_model() -> None:
    with pytest.raises(ValueError, match=r"Invalid rank 8 of world 8"):
        plan_model(MODELS["llama-7b"], "muon", world=8, link="pcie4", swap_times=4, rank=8)
    with pytest.raises(ValueError, match=r"Unknown link preset 'pcie9'"):
        plan_model(MODELS["llama-7b"], "adamw", world=8, link="pcie9", swap_times=4)
    with pytest.raises(ValueError, match=r"Unknown planner optimizer 'lbfgs'"):
        plan_model(MODELS["llama-7b"], "lbfgs", world=8, link="pcie4", swap_times=4)
    with pytest.raises(ValueError, match=r"Invalid ranks_per_node: 0 \(expected >= 1\)"):
        plan_model(MODELS["llama-7b"], "adamw", world=8, link="pcie4", swap_times=4, ranks_per_node=0)


def test_a_hugging_face_config_json_is_a_model(tmp_path: Path) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "llama-2-7b" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    model = ModelShape.from_config_json(path)
    assert model.name == "llama-2-7b" and model.numel == MODELS["llama-7b"].numel
    del config["intermediate_size"]
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="needs intermediate_size"):
        ModelShape.from_config_json(path)
    with pytest.raises(ValueError, match=r"num_key_value_heads must be in \[1, num_attention_heads=32\], got 64"):
        ModelShape("bad", 4096, 11008, 2, 32, 64, 32000)


def test_plan_command_writes_the_versioned_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    argv = [*PLAN, "--model", "llama-1b", "--world", "8", "--link", "pcie4", "ascend-910b", "--swap-times", "2", "4"]
    assert main([*argv, "--master-weights", "--json", str(path)]) == 0
    document: dict[str, Any] = json.loads(path.read_text())
    assert document["schema"] == SCHEMA and document["kind"] == "plan"
    assert document["models"]["llama-1b"]["numel"] == MODELS["llama-1b"].numel
    rows = document["modeled_rows"]
    assert [(row["link"], row["swap_times"]) for row in rows] == [
        ("pcie4", 2),
        ("pcie4", 4),
        ("ascend-910b", 2),
        ("ascend-910b", 4),
    ]
    assert len({row["host_state_bytes"] for row in rows}) == 1  # bytes do not depend on the link or k
    output = capsys.readouterr().out
    assert "seconds are modeled, not measured" in output and "llama-1b +masters" in output
    with pytest.raises(SystemExit):
        main([*PLAN, "--model", "gpt-9"])
    assert "neither a preset" in capsys.readouterr().err


def test_plan_with_tokens_models_whole_iterations_and_skips_what_it_cannot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--tokens``: each combination's iteration as :func:`~swap_bench.iteration.model_iteration` gives it; ranks
    per node above the world is a skipped row."""
    path = tmp_path / "plan.json"
    argv = [*PLAN, "--model", "llama-1b", "--world", "2", "--link", "pcie5-achievable", "--swap-times", "4"]
    assert main([*argv, "--tokens", "2048", "--ranks-per-node", "1", "4", "--json", str(path)]) == 0
    document: dict[str, Any] = json.loads(path.read_text())
    expected = model_iteration(
        IterationModel(MODELS["llama-1b"], 2, 2048, OPTIMIZERS["adamw"], "pcie5-achievable", swap_times=4)
    )
    assert document["iteration_rows"] == [expected.as_dict()]
    assert any("iteration" in row["row"] and "ranks_per_node" in row["reason"] for row in document["skipped"])
    assert "one rank's training iteration" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*argv, "--tokens", "2048", "--utilization", "1.5"])
    assert "must be a number in (0, 1], got 1.5" in capsys.readouterr().err


def test_plan_with_staging_buffers_models_each_count_in_the_step_and_iteration_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--staging-buffers 2 3``: a row each; the third buffer holds one more of llama-7b's balanced batches on the
    device (the exact bytes of any batches are the conformance suite's accounting checks) and moves the same
    bytes."""
    path, markdown = tmp_path / "plan.json", tmp_path / "plan.md"
    argv = [*PLAN, "--model", "llama-7b", "--world", "8", "--link", "pcie5-achievable", "--swap-times", "8"]
    argv += ["--master-weights", "--staging-buffers", "2", "3", "--tokens", "2048"]
    assert main([*argv, "--json", str(path), "--markdown", str(markdown)]) == 0
    document: dict[str, Any] = json.loads(path.read_text())
    two, three = document["modeled_rows"]
    assert (two["staging_buffers"], three["staging_buffers"]) == (2, 3)
    assert three["device_peak_state_bytes"] == pytest.approx(1.5 * two["device_peak_state_bytes"], rel=0.02)
    assert three["device_peak_state_bytes"] > two["device_peak_state_bytes"]
    assert (three["h2d_bytes"], three["copies"]) == (two["h2d_bytes"], two["copies"])
    spec = IterationModel(
        MODELS["llama-7b"], 8, 2048, OPTIMIZERS["adamw"], "pcie5-achievable", 8, master_weights=True, staging_buffers=3
    )
    assert document["iteration_rows"][1] == model_iteration(spec).as_dict()
    assert "| 8 (3 staged) |" in markdown.read_text()
    assert "8 (3 staged)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*PLAN, "--model", "llama-1b", "--staging-buffers", "1"])
    assert "argument --staging-buffers: must be an integer >= 2, got 1" in capsys.readouterr().err


def test_plan_command_models_achievable_figures_and_ranks_sharing_a_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """16 ranks on a host whose memory sustains 450.56 GB/s (PCIe 5, achievable figures) get 28.16 GB/s each, below
    the link's 55 GB/s: the row says which figures it used, and its copies go at the host share."""
    path, markdown = tmp_path / "plan.json", tmp_path / "plan.md"
    argv = [*PLAN, "--model", "llama-1b", "--link", "pcie5-achievable", "--ranks-per-node", "16", "--swap-times", "2"]
    assert main([*argv, "--json", str(path), "--markdown", str(markdown)]) == 0
    (row,) = json.loads(path.read_text())["modeled_rows"]
    assert (row["link"], row["ranks_per_node"]) == ("pcie5-achievable", 16)
    figures = {"h2d_gbps": 55.0, "d2h_gbps": 55.0, "duplex_factor": 1.4, "host_memory_gbps": 450.56}
    assert {key: row["link_model"][key] for key in figures} == figures and row["link_model"]["ranks_sharing_host"] == 16
    host_share = 450.56e9 / 16
    copy_in = row["h2d_bytes"] / host_share  # alone at the host share, not at the link's 55 GB/s
    assert row["link_utilization"] == pytest.approx(copy_in / row["modeled_transfer_seconds"], rel=1e-12)
    assert row["modeled_transfer_seconds"] > copy_in
    # Two directions sharing 28.16 GB/s: no batch's copy-in and copy-out together beat their bytes over the share.
    batch_in, batch_out = copy_in / 2, row["d2h_bytes"] / host_share / 2
    assert row["bound_seconds"] == pytest.approx(batch_in + batch_out + (batch_in + batch_out), rel=1e-9)
    assert "| pcie5-achievable | 16 | 2 |" in markdown.read_text()
    assert "pcie5-achievable" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*PLAN, "--model", "llama-1b", "--ranks-per-node", "0"])
    assert "argument --ranks-per-node: must be an integer >= 1, got 0" in capsys.readouterr().err


def test_the_planner_models_the_foreach_kernels_torch_picks_on_cuda() -> None:
    """On meta tensors torch would pick its single-tensor kernels, which touch more bytes than CUDA's default."""
    model = MODELS["llama-1b"]
    planned = plan_model(model, "adamw", world=8, link="pcie4", swap_times=4)
    tensors = [(fsdp_shard_shape(shape, 8, 0), torch.float32) for _, shape in model.parameter_shapes()]
    single_tensor = model_step(StepModel(model.name, tensors, OPTIMIZERS["adamw"], "pcie4", 4, world=8))
    assert planned.host_state_bytes == single_tensor.host_state_bytes
    assert planned.update_seconds < single_tensor.update_seconds


def _llama_1b_matrices() -> list[tuple[int, int]]:
    """Llama 3.2 1B's 2-D parameters by hand: 2048 wide, 16 layers, MLP 8192, 8 key/value heads of 64, vocab
    128256, embeddings tied to the head (one matrix)."""
    layer = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)]
    return [(128256, 2048), *(layer * 16)]


def test_distributed_muon_owns_every_matrix_on_exactly_one_rank() -> None:
    """Each rank swaps the whole momentum of the matrices it owns, and together the ranks own each matrix once."""
    pytest.importorskip("swap_muon", reason="distributed Muon is swap-muon's")
    from swap_muon.owner_plan import plan_owners

    world = 4
    matrices = _llama_1b_matrices()
    rows = [plan_model(MODELS["llama-1b"], "muon", world=world, link="pcie4", swap_times=4, rank=r) for r in range(4)]
    assert not dist.is_initialized()  # each row's fake process group is gone
    plan = plan_owners(matrices, [torch.float32] * len(matrices), world)
    for rank, row in enumerate(rows):
        assert row.world == world and row.rank == rank and row.optimizer == "muon"
        assert row.params == sum(-(-m // world) * n for m, n in matrices)  # every rank's shard of every matrix
        owned = 4 * sum(math.prod(matrices[index]) for index in plan.owned_by(rank))  # fp32 momentum, whole
        assert row.host_state_bytes == row.h2d_bytes == row.d2h_bytes == row.plain_state_device_bytes == owned
    assert sum(row.host_state_bytes for row in rows) == 4 * sum(m * n for m, n in matrices)


def test_distributed_muon_is_bound_by_newton_schulz_and_stays_at_the_pipeline_bound() -> None:
    """Muon's update outlasts its copies on a 70B shard: the bound is then T_c + (S/B_down + S/B_up) / k."""
    pytest.importorskip("swap_muon", reason="distributed Muon is swap-muon's")
    row = plan_model(MODELS["llama-70b"], "muon", world=8, link="pcie4", swap_times=4, master_weights=True)
    assert row.params == _llama_70b_rank0_numel(world=8) - 80 * 2 * 1024 - 1024  # no RMSNorm weights
    copy_in = row.h2d_bytes / (PCIE4.h2d_gbps * 1e9)
    copy_out = row.d2h_bytes / (PCIE4.d2h_gbps * 1e9)
    assert row.update_seconds > max(copy_in, copy_out)  # Newton-Schulz on whole matrices at 312 TFLOPS
    assert row.bound_seconds == pytest.approx(row.update_seconds + (copy_in + copy_out) / row.batches)
    assert row.update_seconds < row.modeled_transfer_seconds <= 1.02 * row.bound_seconds


def test_a_fake_world_is_torn_down_on_failure_and_refused_inside_a_process_group() -> None:
    def failing_build(params: list[torch.nn.Parameter], **options: object) -> torch.optim.Optimizer:
        raise RuntimeError("planted failure")

    failing = OptimizerSpec("failing", failing_build)
    model = StepModel("toy", [((8, 4), torch.float32)], failing, "pcie4", 1, world=2, rank=1, fsdp2=True)
    with pytest.raises(RuntimeError, match="planted failure"):
        model_step(model)
    assert not dist.is_initialized()
    with fake_world(1, 0):
        with pytest.raises(RuntimeError, match=r"torch\.distributed is already initialized"):
            plan_model(MODELS["llama-1b"], "muon", world=2, link="pcie4", swap_times=2)
        assert dist.get_world_size() == 1  # the caller's group is left alone
    assert not dist.is_initialized()


def test_plan_command_models_one_rank_of_distributed_muon(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("swap_muon", reason="distributed Muon is swap-muon's")
    path = tmp_path / "plan.json"
    argv = [*PLAN, "--model", "llama-1b", "--optimizer", "muon", "--world", "2", "--rank", "1", "--swap-times", "2"]
    assert main([*argv, "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())["modeled_rows"]
    assert (row["optimizer"], row["world"], row["rank"]) == ("muon", 2, 1)
    assert "rank 1 of an FSDP2 shard" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*PLAN, "--model", "llama-1b", "--world", "2", "--rank", "2"])
    assert "--rank must be in [0, 2) for --world 2, got 2" in capsys.readouterr().err


def test_the_planner_recommends_the_fewest_batches_whose_staging_fits_the_device_memory() -> None:
    device_memory = 600 * 10**6
    chosen, neighbours = recommend(MODELS["llama-1b"], "adamw", device_memory=device_memory, world=8, link="pcie5")
    assert chosen.swap_times == "auto" and chosen.batches_label == f"{chosen.batches} (auto)"
    budget = 0.8 * device_memory  # llama-1b keeps no state resident: the staging is the device peak
    assert chosen.device_peak_state_bytes <= budget
    fewer = plan_model(MODELS["llama-1b"], "adamw", world=8, link="pcie5", swap_times=chosen.batches - 1)
    assert fewer.device_peak_state_bytes > budget, "one batch fewer would not fit: the choice is the fewest"
    assert [row.batches for row in neighbours] == [chosen.batches + 1, 2 * chosen.batches]
    assert all(row.device_peak_state_bytes < chosen.device_peak_state_bytes for row in neighbours)


def test_plan_with_device_memory_prints_the_recommendation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    argv = [*PLAN, "--model", "llama-1b", "--link", "pcie5", "--device-memory", "0.6GB", "--json", str(path)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "recommended for llama-1b world=8 pcie5: swap_times=" in printed
    rows = json.loads(path.read_text())["modeled_rows"]
    assert rows[0]["swap_times"] == "auto" and rows[0]["device_memory"] == 600 * 10**6 and len(rows) == 3


@pytest.mark.parametrize(
    "text,size", [("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("512 MB", 512 * 10**6), ("4096", 4096)]
)
def test_sizes_take_decimal_and_binary_units(text: str, size: int) -> None:
    assert byte_size(text) == size


@pytest.mark.parametrize("text", ["80XB", "big", "0GB"])
def test_a_bad_device_memory_is_an_error_line(text: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*PLAN, "--model", "llama-1b", "--device-memory", text])
    assert exit_info.value.code == 2


def test_distributed_muon_plans_once_not_at_every_step() -> None:
    """Matrices another rank owns keep no state: asked for one at every step, they must not make the plan be built
    again each time (it was: 4 plans for the planner's 2 optimizers of 2 steps each, staging arenas allocated)."""
    with planted.plans_built() as built:
        plan_model(MODELS["llama-1b"], "muon", world=4, link="pcie4", swap_times=4)
    assert len(built) == 2, f"{len(built)} plans for two optimizers stepped twice each"
