"""One rank of a world that does not exist: a fake process group and its device mesh, for modeled steps.

Distributed Muon (swap-muon) needs a process group: it plans which rank owns each matrix, checks that
every rank planned alike, and moves rows with ``all_to_all``. Over meta tensors none of that moves data,
so the planner runs it as one rank of ``world`` on torch's fake process group, which completes every
collective at once (``all_gather_object`` returns this rank's own object). The group is the process's
default group while the context lasts, and is destroyed when it ends, whatever happens inside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed import HashStore  # type: ignore[attr-defined]  # public, not in torch's stubs' exports
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from swap_core.torch_compat import import_modules_binding_the_default_group

from .torch_compat import FAKE_BACKEND, register_fake_process_group_backend

__all__ = ["fake_world"]


@contextlib.contextmanager
def fake_world(world: int, rank: int) -> Iterator[DeviceMesh]:
    """A 1-D device mesh of ``world`` fake ranks, seen from ``rank``; the default group while it lasts."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"Invalid fake world: rank {rank} of world {world}")
    if dist.is_initialized():
        raise RuntimeError(
            "swap-bench models a distributed step on a fake process group of its own, but torch.distributed is "
            "already initialized in this process: run the planner in a process without a process group"
        )
    register_fake_process_group_backend()
    import_modules_binding_the_default_group()  # else they would hold the fake group after it is gone
    dist.init_process_group(FAKE_BACKEND, rank=rank, world_size=world, store=HashStore())
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()
