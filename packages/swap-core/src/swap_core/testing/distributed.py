"""Run a test body on several gloo ranks (CPU), with the first failure reported to the caller.

One process group per call, torn down afterwards; bodies that share a world
size should be grouped into one call (a list of checks run by the same ranks)
to keep the suite fast. Workers start with ``forkserver``: cheap, and safe after
torch has started its thread pools (``fork`` is not).
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistributedTestError", "run_distributed"]

RankBody = Callable[..., None]


class DistributedTestError(AssertionError):
    """A rank failed; the message holds that rank's traceback."""


def run_distributed(body: RankBody, world_size: int, *args: Any, timeout_s: float = 120.0) -> None:
    """Call ``body(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise the first rank failure.

    ``body`` must be importable by name (a module-level function) so workers can load it.
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    context = mp.get_context("forkserver")
    errors = context.SimpleQueue()
    port = _free_port()
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
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            body(rank, world_size, *args)
            # Tear the groups down together: a rank destroying them while its peer is still in a collective
            # on them can abort in gloo's teardown ("terminate called without an active exception").
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
