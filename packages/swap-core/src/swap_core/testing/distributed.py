"""Run a test body on several gloo ranks (CPU), with the first failure reported to the caller.

One process group per call, torn down afterwards; bodies that share a world
size should be grouped into one call (a list of checks run by the same ranks)
to keep the suite fast. Workers start with ``forkserver``: safe after torch has started
its thread pools (``fork`` is not), and cheap, since the server imports torch and its
distributed modules once (:data:`FORKSERVER_PRELOAD`) and every worker forks from it
with them loaded, instead of importing them again (measured here: a 2-rank world
started and joined in about 1 s instead of 7-9 s, on the 2-core machine under load).

:func:`~swap_core.distributed.destroy_process_groups` (or
:func:`~swap_core.distributed.initialized_process_group` around the work), re-exported here, is the one teardown
of every distributed test and script of swap.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in torch's stubs' exports

from swap_core.distributed import ProcessGroupLeakError, destroy_process_groups, initialized_process_group
from swap_core.torch_compat import import_modules_binding_the_default_group

__all__ = [
    "FORKSERVER_PRELOAD",
    "DistributedTestError",
    "ProcessGroupLeakError",
    "destroy_process_groups",
    "fsdp2_linears",
    "initialized_process_group",
    "run_distributed",
]

RankBody = Callable[..., None]

FORKSERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "pytest",
    "swap_core",
    "swap_core.distributed",
    "swap_core.testing.distributed",
)
"""Modules the worker server imports once, before any process group exists (so none binds one); each
worker forks with them loaded. One that fails to import is skipped by multiprocessing."""

if dist.is_available() and not dist.is_initialized():
    # Imported before init_process_group (as imports usually are), these torch modules bind no group.
    import_modules_binding_the_default_group()


class DistributedTestError(AssertionError):
    """A rank failed; the message holds that rank's traceback."""


def run_distributed(body: RankBody, world_size: int, *args: Any, timeout_s: float = 120.0) -> None:
    """Call ``body(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise the first rank failure.

    ``body`` must be importable by name (a module-level function) so workers can load it.
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # read when the server starts (first call only)
    errors = context.SimpleQueue()
    # The ranks meet at a store served from here, on a port the OS assigns while the server holds it. A
    # port found free here and bound later by rank 0 could be taken in between by a world started beside
    # this one (pytest-xdist runs tests in parallel processes).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, body, args, errors), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout_s)
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        rank, message = sorted(failures)[0]
        raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{message}")
    if hung:
        raise DistributedTestError(f"ranks {hung} of {world_size} did not finish within {timeout_s} s (a hang?)")
    crashed = [rank for rank, process in enumerate(processes) if process.exitcode != 0]
    if crashed:
        codes = [processes[rank].exitcode for rank in crashed]
        raise DistributedTestError(f"ranks {crashed} of {world_size} exited with codes {codes}")


def _worker(rank: int, world_size: int, port: int, body: RankBody, args: tuple[Any, ...], errors: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        store = TCPStore("127.0.0.1", port, world_size, is_master=False)
        with initialized_process_group("gloo", store=store, rank=rank, world_size=world_size):
            body(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None


def fsdp2_linears(mesh: Any, width: int, layers: int = 4) -> torch.nn.Sequential:
    """``layers`` ``Linear(width, width)`` seeded alike on every rank (and every call), each and the whole sharded
    with FSDP2 over ``mesh``: the model of the FSDP2 gradient-hook tests."""
    from torch.distributed.fsdp import fully_shard

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
