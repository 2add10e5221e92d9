"""Run a test body on several gloo ranks (CPU), with the first failure reported to the caller.

One process group per call, torn down afterwards; bodies that share a world
size should be grouped into one call (a list of checks run by the same ranks)
to keep the suite fast. Workers start with ``forkserver``: safe after torch has started
its thread pools (``fork`` is not), and cheap, since the server imports torch and its
distributed modules once (:data:`FORKSERVER_PRELOAD`) and every worker forks from it
with them loaded, instead of importing them again (measured here: a 2-rank world
started and joined in about 1 s instead of 7-9 s, on the 2-core machine under load).

:func:`destroy_process_groups` (or :func:`initialized_process_group` around the work)
is the one teardown of every distributed test and script of swap: it destroys each
process group while the interpreter is fully alive and raises if one outlives it
(see its docstring for the exit abort it prevents).
"""

from __future__ import annotations

import contextlib
import gc
import os
import traceback
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in torch's stubs' exports

from swap_core.torch_compat import (
    import_modules_binding_the_default_group,
    registered_process_groups,
    release_device_mesh_groups,
)

__all__ = [
    "FORKSERVER_PRELOAD",
    "DistributedTestError",
    "ProcessGroupLeakError",
    "destroy_process_groups",
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
    "swap_core.testing.distributed",
)
"""Modules the worker server imports once, before any process group exists (so none binds one); each
worker forks with them loaded. One that fails to import is skipped by multiprocessing."""

if dist.is_available() and not dist.is_initialized():
    # Imported before init_process_group (as imports usually are), these torch modules bind no group.
    import_modules_binding_the_default_group()


class DistributedTestError(AssertionError):
    """A rank failed; the message holds that rank's traceback."""


class ProcessGroupLeakError(RuntimeError):
    """A process group outlived :func:`destroy_process_groups`; the message names what still holds it."""


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


def destroy_process_groups() -> None:
    """Destroy every process group now, while the interpreter is fully alive; raise if one survives.

    Why: ``destroy_process_group`` only forgets the groups. A group whose Python object is still
    referenced keeps its C++ backend, and gloo's worker threads, until interpreter exit. A worker that
    then releases the last reference to a collective's tensor (a finished work, freed late because a
    barrier held it) must take the GIL to free the tensor's Python object; during finalization Python
    3.11-3.13 ends such a thread with ``pthread_exit``, whose unwinding through a C++ destructor calls
    ``std::terminate``: "terminate called without an active exception", SIGABRT, after all the work
    succeeded. Any run with a DeviceMesh is exposed: a mesh holds its groups in a registry that
    ``destroy_process_group`` leaves alone, and DTensor's sharding caches keep meshes alive. So is any
    run that first imports ``torch.distributed.fsdp`` after ``init_process_group``: a module it imports
    binds the default group as a default argument (see :func:`initialized_process_group`).

    So, in order: collect garbage (FSDP modules sit in reference cycles); ``barrier``, so that no
    rank destroys a group its peer still uses; ``destroy_process_group``; drop the groups that live
    meshes still hold; collect again; check that no group object is left. A group still referenced
    (a model, optimizer or mesh the caller keeps) raises :class:`ProcessGroupLeakError` naming its
    holders: a deterministic error instead of an abort in one exit out of ten or twenty. Release
    such objects before calling this. On a failure path, where a peer may be gone, call
    ``destroy_process_group`` alone, as :func:`initialized_process_group` does.
    """
    if not dist.is_initialized():
        return
    gc.collect()
    dist.barrier()
    groups = [(group.group_name, weakref.ref(group)) for group in registered_process_groups()]
    dist.destroy_process_group()
    release_device_mesh_groups()
    gc.collect()
    leaks = []
    for name, reference in groups:
        group = reference()
        if group is not None:
            leaks.append(f"group {name!r} held by {_holders(group)}")
    if leaks:
        raise ProcessGroupLeakError(
            "process groups outlived destroy_process_group(), so gloo's worker threads would live into "
            f"interpreter exit and can abort it (SIGABRT): {'; '.join(leaks)}. Drop the models, optimizers "
            "and meshes that hold them before the teardown."
        )


@contextlib.contextmanager
def initialized_process_group(backend: str = "gloo", **init_options: Any) -> Iterator[None]:
    """``init_process_group(backend, **init_options)`` for the block; :func:`destroy_process_groups` after it.

    Build models, meshes and optimizers in a function called inside the block, so that they are gone
    when the block ends (a name bound in the block itself would keep its group alive). Before the
    init, the torch modules that would bind the default group as a default argument are imported
    (:data:`~swap_core.torch_compat.MODULES_BINDING_THE_DEFAULT_GROUP`). When the block raises, the
    groups are destroyed without the barrier and the leak check, and the error propagates.
    """
    import_modules_binding_the_default_group()
    dist.init_process_group(backend, **init_options)
    try:
        yield
    except BaseException:
        # No barrier (a peer may be gone) and no leak check (the traceback holds the block's objects).
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    destroy_process_groups()


def _holders(obj: object) -> str:
    """What refers to ``obj``: object types, the owner of an attribute dict, a function holding it as a default."""
    names = set()
    for referrer in gc.get_referrers(obj):
        if isinstance(referrer, types.FrameType):
            continue
        if isinstance(referrer, dict):
            owners = {
                type(owner).__name__
                for owner in gc.get_referrers(referrer)
                if getattr(owner, "__dict__", None) is referrer
            }
            names.add(f"a dict of {', '.join(sorted(owners))}" if owners else "a dict")
        elif not isinstance(referrer, tuple):
            names.add(type(referrer).__name__)
    # A tuple of objects the collector does not track (a group is one) is untracked too: look for the
    # functions that hold the group as a default argument.
    functions = sorted(
        f"{function.__module__}.{function.__qualname__}"
        for function in gc.get_objects()
        if isinstance(function, types.FunctionType) and _is_default_argument(obj, function)
    )
    if functions:
        names.add(
            f"the default arguments of {', '.join(functions)} (imported after init_process_group; import them "
            "before, as importing swap_core.testing.distributed does)"
        )
    return "; ".join(sorted(names)) or "an object outside Python's garbage collector"


def _is_default_argument(obj: object, function: types.FunctionType) -> bool:
    defaults = (*(function.__defaults__ or ()), *(function.__kwdefaults__ or {}).values())
    return any(value is obj for value in defaults)


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
