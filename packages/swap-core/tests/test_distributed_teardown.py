"""The one distributed teardown: no process group, and no gloo thread, outlives it into interpreter exit.

torch 2.13 leaves a DeviceMesh's groups alive after ``destroy_process_group`` (the mesh keeps them,
DTensor's sharding caches keep the mesh), and a gloo worker thread alive at interpreter exit can
abort the process (SIGABRT, "terminate called without an active exception"). These tests look at the
threads themselves (Linux names them), so they fail if a group survives the teardown.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from swap_core.testing.distributed import ProcessGroupLeakError, destroy_process_groups, run_distributed
from swap_core.torch_compat import release_device_mesh_groups

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc"),
]


def _gloo_threads() -> list[str]:
    """Names of this process's gloo threads (its worker loops and its TCP loop)."""
    names = (Path(task, "comm").read_text().strip() for task in Path("/proc/self/task").iterdir())
    return sorted(name for name in names if "gloo" in name)


def _train_fsdp2_and_gather() -> torch.nn.Module:
    """FSDP2 + AdamW, then full_tensor(): DTensor's caches now hold the mesh, and the mesh its group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    for parameter in model.parameters():
        parameter.full_tensor()  # type: ignore[operator]
    return model


def _mesh_groups_outlive_torch_destroy(rank: int, world_size: int) -> None:
    _train_fsdp2_and_gather()  # the model is dropped here; only torch's caches remain
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    assert _gloo_threads(), (
        "torch's destroy_process_group now ends a DeviceMesh's gloo threads by itself (torch fixed the leak?): "
        "swap_core.torch_compat.release_device_mesh_groups may no longer be needed"
    )
    assert release_device_mesh_groups() >= 1
    gc.collect()
    assert _gloo_threads() == []


def _teardown_ends_every_gloo_thread(rank: int, world_size: int) -> None:
    _train_fsdp2_and_gather()
    assert _gloo_threads()
    destroy_process_groups()
    assert not dist.is_initialized()
    assert _gloo_threads() == [], "a process group outlived the teardown"


def _teardown_names_a_model_kept_alive(rank: int, world_size: int) -> None:
    model = _train_fsdp2_and_gather()
    with pytest.raises(ProcessGroupLeakError, match=r"group '\d+' held by .*FSDP") as raised:
        destroy_process_groups()
    assert "Drop the models, optimizers and meshes" in str(raised.value)
    assert not dist.is_initialized()
    del model


def test_torch_keeps_device_mesh_groups_alive_past_destroy_process_group() -> None:
    run_distributed(_mesh_groups_outlive_torch_destroy, 2)


def test_teardown_ends_every_gloo_thread_while_python_is_alive() -> None:
    run_distributed(_teardown_ends_every_gloo_thread, 2)


def test_teardown_refuses_a_process_group_kept_alive_by_the_caller() -> None:
    run_distributed(_teardown_names_a_model_kept_alive, 2)
