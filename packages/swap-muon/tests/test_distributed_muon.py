"""Distributed Muon on gloo: owner-rank updates of sharded params equal torch.optim.Muon on full params, bitwise."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from swap_core import SwapConfig, SwapOptimizer, swap_optimizer
from swap_core.errors import StateDictMismatchError, UnsupportedOptimizerError
from swap_core.master_weights import MASTER_KEY, master_of
from swap_core.master_weights.remainder import remainder_nbytes
from swap_core.sim import SimBackend
from swap_core.testing.compare import assert_bitwise_equal
from swap_core.testing.distributed import run_distributed
from swap_core.testing.masters import MasterReference
from swap_muon import owner_checkpoint
from swap_muon.distributed import DistributedMuonAdapter, PlanMismatchError
from swap_muon.owner_plan import plan_owners
from swap_muon.row_exchange import gather_rows_to_owners, scatter_rows_from_owners

pytestmark = [pytest.mark.distributed, pytest.mark.sim_only]

# Uneven row counts on purpose: Shard(0) leaves the last ranks with fewer (or no) rows.
SHAPES = [(40, 24), (17, 32), (48, 48), (3, 40), (24, 64)]
OPTIONS: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}


def _full(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _model(mesh: Any, use_fully_shard: bool) -> list[torch.nn.Parameter]:
    """Sharded copies of the same full matrices: through FSDP2's fully_shard, or distribute_tensor."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = _full(0)
    if use_fully_shard:
        layers = torch.nn.ModuleList(torch.nn.Linear(s[1], s[0], bias=False) for s in SHAPES)
        for layer, weight in zip(layers, full, strict=True):
            layer.weight.data.copy_(weight)
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        return [layer.weight for layer in layers]
    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    return [torch.nn.Parameter(distribute_tensor(weight, mesh, placements)) for weight in full]


def _give_grads(sharded: list[torch.nn.Parameter], reference_params: list[torch.nn.Parameter], seed: int) -> None:
    """The same full gradients to the reference and, sharded like each parameter, to the swapped one."""
    from torch.distributed.tensor import distribute_tensor

    for param, reference_param, grad in zip(sharded, reference_params, _full(seed), strict=True):
        reference_param.grad = grad
        param.grad = distribute_tensor(grad, param.device_mesh, param.placements)  # type: ignore[attr-defined]


def _parity_body(rank: int, world_size: int, mesh_shape: tuple[int, ...], use_fully_shard: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    reference_params = [torch.nn.Parameter(weight) for weight in _full(0)]
    reference = torch.optim.Muon(reference_params, **OPTIONS)
    sharded = _model(mesh, use_fully_shard)
    config = SwapConfig(backend=SimBackend(mode="random", seed=rank), swap_times=2, min_numel=16)
    opt = swap_optimizer(torch.optim.Muon(sharded, **OPTIONS), config)  # the entry point picks owner-rank Muon
    adapter = opt.adapter
    assert isinstance(adapter, DistributedMuonAdapter)
    for step in range(5):
        _give_grads(sharded, reference_params, 100 + step)
        reference.step()
        opt.step()
    where = f"rank {rank} mesh {mesh_shape} fully_shard={use_fully_shard}"
    opt.synchronize()
    owned_bytes = owned_count = 0
    for index, (param, reference_param) in enumerate(zip(sharded, reference_params, strict=True)):
        assert_bitwise_equal(reference_param, param.full_tensor(), f"{where}: parameter {index}")  # type: ignore[attr-defined]
        state = opt.state[param]
        if adapter.owner_of(param) == adapter.shards.rank:
            momentum = reference.state[reference_param]["momentum_buffer"]
            assert_bitwise_equal(momentum, state["momentum_buffer"], f"{where}: momentum {index}")
            owned_bytes += momentum.numel() * momentum.element_size()
            owned_count += 1
        else:
            assert "momentum_buffer" not in state, f"{where}: momentum {index} held by a rank that does not own it"
    # Per rank, host memory holds the full momentum of the matrices this rank owns and nothing else
    # (up to the packed buffer's 64-byte alignment between states).
    host_bytes = opt.stats.host_state_bytes
    assert owned_bytes <= host_bytes <= owned_bytes + 64 * max(owned_count - 1, 0), f"{where}: {host_bytes} host bytes"
    plans: list[object] = [None] * world_size
    dist.all_gather_object(plans, adapter.plan.owners)
    assert all(plan == plans[0] for plan in plans), f"{where}: plans differ {plans}"
    # state_dict() has torch.optim.Muon's layout: every rank holds its shard of every momentum, placed like
    # the parameter (a collective: owners scatter); loading gathers the shards back onto the owners.
    saved = opt.state_dict()
    for index, (param, reference_param) in enumerate(zip(sharded, reference_params, strict=True)):
        momentum = saved["state"][index]["momentum_buffer"]
        assert momentum.placements == param.placements, f"{where}: momentum {index} {momentum.placements}"  # type: ignore[attr-defined]
        expected = reference.state[reference_param]["momentum_buffer"]
        assert_bitwise_equal(expected, momentum.full_tensor(), f"{where}: saved momentum {index}")
    # The same exchange through device buffers, as on a device-only backend (NCCL, HCCL), gives the same bytes.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(owner_checkpoint, "exchange_device", lambda shards: None)
        staged = opt.state_dict()
        for index, entry in saved["state"].items():
            momentum = staged["state"][index]["momentum_buffer"]
            assert_bitwise_equal(entry["momentum_buffer"].to_local(), momentum.to_local(), f"{where}: staged {index}")
        opt.load_state_dict(staged)
    opt.load_state_dict(saved)
    _give_grads(sharded, reference_params, 200)
    reference.step()
    opt.step()
    for index, (param, reference_param) in enumerate(zip(sharded, reference_params, strict=True)):
        assert_bitwise_equal(reference_param, param.full_tensor(), f"{where}: parameter {index} after reload")  # type: ignore[attr-defined]


def _mismatch_body(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    params = [torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)])) for weight in _full(0)]
    if rank == 1:
        params.reverse()  # a different parameter order on one rank
    with pytest.raises(PlanMismatchError, match="owner plans differ between ranks"):
        SwapOptimizer(torch.optim.Muon(params), SwapConfig(backend="sim"), DistributedMuonAdapter)


def _unsupported_placement_body(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    params = [torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)])) for weight in _full(0)]
    params[1] = torch.nn.Parameter(distribute_tensor(_full(0)[1], mesh, [Shard(1)]))
    with pytest.raises(UnsupportedOptimizerError, match=r"Parameter 1 \(17, 32\) has placements \(Shard\(dim=1\),\)"):
        swap_optimizer(torch.optim.Muon(params), SwapConfig(backend="sim"))


def _state_dict_loads_body(rank: int, world_size: int) -> None:
    """A plain full-tensor Muon state dict loads onto the owners; ranks loading different entries all raise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    reference_params = [torch.nn.Parameter(weight) for weight in _full(0)]
    reference = torch.optim.Muon(reference_params, **OPTIONS)
    for param, grad in zip(reference_params, _full(100), strict=True):
        param.grad = grad
    reference.step()
    sharded = [torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)])) for weight in _full(0)]
    opt = swap_optimizer(torch.optim.Muon(sharded, **OPTIONS), SwapConfig(backend="sim", min_numel=16))
    opt.load_state_dict(reference.state_dict())  # whole tensors: each owner keeps its own, no collective moves
    for index, reference_param in enumerate(reference_params):
        expected = reference.state[reference_param]["momentum_buffer"]
        momentum = opt.state_dict()["state"][index]["momentum_buffer"].full_tensor()
        assert_bitwise_equal(expected, momentum, f"rank {rank}: momentum {index} loaded from full tensors")
    before = opt.state_dict()
    inconsistent = opt.state_dict()
    if rank == 1:
        del inconsistent["state"][2]["momentum_buffer"]
    with pytest.raises(StateDictMismatchError, match=r"'momentum_buffer' of parameter 2 differs between the ranks"):
        opt.load_state_dict(inconsistent)
    for index, entry in before["state"].items():  # nothing changed
        after = opt.state_dict()["state"][index]["momentum_buffer"]
        assert_bitwise_equal(entry["momentum_buffer"].to_local(), after.to_local(), f"rank {rank}: momentum {index}")


def _row_exchange_body(rank: int, world_size: int) -> None:
    """The batch collectives alone: mixed dtypes and odd byte sizes in one buffer, an empty block, bad rows."""
    group = dist.group.WORLD
    assert group is not None
    generator = torch.Generator().manual_seed(7)
    fulls = [
        torch.randn(5, 3, generator=generator).to(torch.bfloat16),  # 2 x 3 x 2 bytes on rank 1: not 16-aligned
        torch.randn(4, 7, generator=generator),
        torch.randn(1, 2, generator=generator).to(torch.float64),  # rank 1 holds no row
    ]
    owners = [1, 0, 1]
    shapes = [full.shape for full in fulls]
    blocks = [
        torch.chunk(full, world_size)[rank] if rank < len(torch.chunk(full, world_size)) else full[:0] for full in fulls
    ]
    gathered = gather_rows_to_owners(blocks, shapes, owners, group)
    for index, (full, owner) in enumerate(zip(fulls, owners, strict=True)):
        if owner == rank:
            assert_bitwise_equal(full, gathered[index], f"rank {rank}: matrix {index} gathered on its owner")
        else:
            assert gathered[index] is None
    updates = [full.to(torch.bfloat16) if owner == rank else None for full, owner in zip(fulls, owners, strict=True)]
    scattered = scatter_rows_from_owners(updates, shapes, torch.bfloat16, owners, group, torch.device("cpu"))
    for index, (block, received) in enumerate(zip(blocks, scattered, strict=True)):
        assert_bitwise_equal(block.to(torch.bfloat16), received, f"rank {rank}: rows of matrix {index}")
    with pytest.raises(ValueError, match=r"Matrix 1 \(4, 7\): this rank holds 4 rows, torch.chunk over 2 ranks"):
        gather_rows_to_owners([blocks[0], fulls[1], blocks[2]], shapes, owners, group)


def _edited_params_body(rank: int, world_size: int) -> None:
    """Param groups edited to another order are refused on every rank, before anything changes; new parameter
    objects of the same shapes (reset_optimizer_parameters) keep the owner plan and stay exact."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    reference_params = [torch.nn.Parameter(weight) for weight in _full(0)]
    reference = torch.optim.Muon(reference_params, **OPTIONS)
    sharded = [torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)])) for weight in _full(0)]
    opt = swap_optimizer(torch.optim.Muon(sharded, **OPTIONS), SwapConfig(backend="sim", swap_times=2, min_numel=16))

    def step(seed: int) -> None:
        for param, reference_param, grad in zip(sharded, reference_params, _full(seed), strict=True):
            reference_param.grad = grad
            param.grad = distribute_tensor(grad, mesh, [Shard(0)])
        reference.step()
        opt.step()

    step(300)
    opt.param_groups[0]["params"].reverse()
    before = [param.to_local().clone() for param in sharded]  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedOptimizerError, match="Distributed Muon assigned owner ranks to its 5 parameters"):
        opt.step()
    for index, (saved, param) in enumerate(zip(before, sharded, strict=True)):
        assert_bitwise_equal(saved, param.to_local(), f"rank {rank}: parameter {index} after the refused step")  # type: ignore[attr-defined]
    opt.param_groups[0]["params"].reverse()
    replacements = [torch.nn.Parameter(param.detach().clone()) for param in sharded]
    opt.reset_optimizer_parameters(dict(zip(replacements, sharded, strict=True)))
    sharded[:] = replacements
    step(301)
    for index, (param, reference_param) in enumerate(zip(sharded, reference_params, strict=True)):
        assert_bitwise_equal(reference_param, param.full_tensor(), f"rank {rank}: parameter {index} after the rebind")  # type: ignore[attr-defined]


def _masters_body(rank: int, world_size: int, mesh_shape: tuple[int, ...], mode: str) -> None:
    """bf16 sharded matrices with master_weights=True: bitwise torch.optim.Muon over full fp32 masters, with each
    rank's master shard and the owners' fp32 momentum swapped; the checkpoint resumes bitwise in a new optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    placements = [Shard(0)] if len(mesh_shape) == 1 else [Replicate(), Shard(0)]
    reference = MasterReference([weight.bfloat16() for weight in _full(0)], lambda ps: torch.optim.Muon(ps, **OPTIONS))

    def wrapped(weights: list[torch.Tensor], seed: int) -> tuple[list[torch.nn.Parameter], SwapOptimizer]:
        params = [torch.nn.Parameter(distribute_tensor(weight, mesh, placements)) for weight in weights]
        config = SwapConfig(
            backend=SimBackend(mode=mode, seed=seed),  # type: ignore[arg-type]
            swap_times=2,
            min_numel=16,
            master_weights=True,
        )
        return params, swap_optimizer(torch.optim.Muon(params, **OPTIONS), config)

    def step(params: list[torch.nn.Parameter], opt: SwapOptimizer, seed: int) -> None:
        for param, reference_param, grad in zip(params, reference.params, _full(seed), strict=True):
            reference_param.grad = grad.bfloat16()
            param.grad = distribute_tensor(grad.bfloat16(), mesh, placements)
        reference.step()
        opt.step()

    def check(params: list[torch.nn.Parameter], opt: SwapOptimizer, where: str) -> int:
        """Everything bitwise the reference; returns the bytes this rank should hold in host memory."""
        opt.synchronize()
        adapter = opt.adapter
        assert isinstance(adapter, DistributedMuonAdapter)
        expected_host = 0
        for index, (param, reference_param, master) in enumerate(
            zip(params, reference.params, reference.masters, strict=True)
        ):
            state = opt.state[param]
            assert_bitwise_equal(reference_param, param.full_tensor(), f"{where}: parameter {index}")  # type: ignore[attr-defined]
            held = master_of(opt, param)  # bf16: the shard's remainder (2.125 B an element) joined with it
            assert held is not None
            assert_bitwise_equal(master, held.full_tensor(), f"{where}: master {index}")
            expected_host += remainder_nbytes(held.to_local().numel())
            if adapter.owner_of(param) == adapter.shards.rank:
                momentum = reference.optimizer.state[master]["momentum_buffer"]
                assert state["momentum_buffer"].dtype == torch.float32
                assert_bitwise_equal(momentum, state["momentum_buffer"], f"{where}: momentum {index}")
                expected_host += momentum.numel() * 4
            else:
                assert "momentum_buffer" not in state, f"{where}: momentum {index} off its owner"
        return expected_host

    params, opt = wrapped([weight.bfloat16() for weight in _full(0)], seed=rank)
    where = f"rank {rank} mesh {mesh_shape} {mode} with master weights"
    for seed in range(100, 104):
        step(params, opt, seed)
        expected_host = check(params, opt, f"{where}, step {seed - 100}")
    # Host memory: this rank's master shards and the whole fp32 momentum of the matrices it owns (packed, with
    # at most 64 bytes of alignment between states of one dtype).
    host = opt.stats.host_state_bytes
    assert expected_host <= host <= expected_host + 64 * 2 * len(SHAPES), f"{where}: {host} host bytes"
    saved = opt.state_dict()
    for index, param in enumerate(params):
        entry = saved["state"][index]
        assert entry[MASTER_KEY].placements == param.placements  # type: ignore[attr-defined]
        assert entry["momentum_buffer"].dtype == torch.float32, "scattered in fp32, as the owner holds it"
    resumed_params, resumed = wrapped([param.detach().full_tensor() for param in params], seed=rank + 10)  # type: ignore[attr-defined]
    resumed.load_state_dict(saved)
    step(resumed_params, resumed, 200)
    check(resumed_params, resumed, f"{where}, resumed")


class _CountReads(TorchFunctionMode):
    """Counts ``.item()`` reads of one tensor."""

    def __init__(self, watched: torch.Tensor) -> None:
        super().__init__()
        self.watched = watched
        self.reads = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.item and args and args[0] is self.watched:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _tensor_lr_body(rank: int, world_size: int) -> None:
    """A tensor ``lr``: bitwise torch's Muon, read once per step (``.item()`` syncs where it lives), not per batch."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    options = {**OPTIONS, "lr": torch.tensor(0.02)}
    reference_params = [torch.nn.Parameter(weight) for weight in _full(0)]
    reference = torch.optim.Muon(reference_params, **options)
    sharded = _model(mesh, use_fully_shard=False)
    config = SwapConfig(backend=SimBackend(mode="lazy"), swap_times=3, min_numel=16)
    opt = swap_optimizer(torch.optim.Muon(sharded, **{**options, "lr": torch.tensor(0.02)}), config)
    for step in range(3):
        _give_grads(sharded, reference_params, 300 + step)
        reference.step()
        with _CountReads(opt.param_groups[0]["lr"]) as counted:
            opt.step()
        assert counted.reads == 1, f"rank {rank}: the tensor lr was read {counted.reads} times in one step of 3 batches"
    opt.synchronize()
    for index, (param, reference_param) in enumerate(zip(sharded, reference_params, strict=True)):
        assert_bitwise_equal(reference_param, param.full_tensor(), f"rank {rank}: parameter {index}")  # type: ignore[attr-defined]


def _auto_batches_body(rank: int, world_size: int) -> None:
    """``swap_times="auto"`` with ranks that see different free device memory: every rank takes the count the
    tightest one needs (they walk the same batches and exchange rows per batch), and steps as full Muon."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    reference_params = [torch.nn.Parameter(weight) for weight in _full(0)]
    reference = torch.optim.Muon(reference_params, **OPTIONS)
    sharded = _model(mesh, use_fully_shard=False)
    device_memory = AUTO_DEVICE_MEMORY if rank == 1 else 1 << 30  # rank 0 alone would take one batch
    config = SwapConfig(backend=SimBackend(mode="random", seed=rank, device_memory=device_memory), swap_times="auto")
    opt = swap_optimizer(torch.optim.Muon(sharded, **OPTIONS), dataclasses.replace(config, min_numel=16))
    for step in range(3):
        for param, reference_param, grad in zip(sharded, reference_params, _full(300 + step), strict=True):
            reference_param.grad = grad
            param.grad = distribute_tensor(grad, param.device_mesh, param.placements)  # type: ignore[attr-defined]
        reference.step()
        opt.step()
    for index, (param, reference_param) in enumerate(zip(sharded, reference_params, strict=True)):
        assert_bitwise_equal(reference_param, param.full_tensor(), f"rank {rank}: parameter {index}")  # type: ignore[attr-defined]
    counts: list[object] = [None] * world_size
    dist.all_gather_object(counts, opt.stats.batches)
    assert len(set(counts)) == 1 and opt.stats.batches > 1, f"batches per rank {counts}: not agreed on"


AUTO_DEVICE_MEMORY = 12 * 1024
"""Rank 1's simulated device in the ``"auto"`` check: too small for all its momenta (12,672 bytes of the four
matrices the owner plan gives it) in one batch; rank 0's (one matrix of 9,216 bytes) would fit it."""


def _two_rank_checks(rank: int, world_size: int) -> None:
    """One process group for every 2-rank check (starting ranks costs more than the checks)."""
    _row_exchange_body(rank, world_size)
    _parity_body(rank, world_size, (2,), False)
    _parity_body(rank, world_size, (2,), True)
    _mismatch_body(rank, world_size)
    _unsupported_placement_body(rank, world_size)
    _state_dict_loads_body(rank, world_size)
    _edited_params_body(rank, world_size)
    _masters_body(rank, world_size, (2,), "lazy")
    _masters_body(rank, world_size, (2,), "random")
    _tensor_lr_body(rank, world_size)
    _auto_batches_body(rank, world_size)


def test_fsdp_two_ranks_match_full_muon_and_refuse_bad_plans() -> None:
    run_distributed(_two_rank_checks, 2)


def _four_rank_checks(rank: int, world_size: int) -> None:
    _parity_body(rank, world_size, (4,), True)  # FSDP2 over 4 ranks: the 3-row matrix leaves ranks empty
    _parity_body(rank, world_size, (2, 2), True)  # HSDP: replicate x shard
    _masters_body(rank, world_size, (2, 2), "random")


def test_fsdp_four_ranks_and_hsdp_two_by_two_match_full_muon() -> None:
    run_distributed(_four_rank_checks, 4)


def test_plan_is_balanced_and_deterministic() -> None:
    shapes = [(64, 64), (64, 64), (32, 32), (32, 32), (16, 16)]
    plan = plan_owners(shapes, [torch.float32] * 5, 2)
    assert plan == plan_owners(shapes, [torch.float32] * 5, 2)
    assert plan.owners == (0, 1, 0, 1, 0)
    assert max(plan.loads) - min(plan.loads) <= 16**3
    assert plan.fingerprint != plan_owners(shapes[::-1], [torch.float32] * 5, 2).fingerprint
