"""Run the distributed tests again and again under CPU load, and count the runs that fail.

A teardown race shows up once in ten or twenty process exits, and more often on a busy machine,
so one green run proves little. This runs ``pytest -m distributed`` over the distributed test files
``--runs`` times in a row while ``--load`` busy-looping processes compete for the cores, keeps
the log of every failed run, and prints the count::

    python tools/stress_distributed.py --runs 30                     # every distributed test file
    python tools/stress_distributed.py --runs 10 integration-tests/test_ckpt_torchrun.py
    python tools/stress_distributed.py --runs 10 --workers 2          # as nox runs them: 2 pytest-xdist workers

Run it in an environment where the swap packages and pytest are installed (a nox session's venv,
or ``pip install -e packages/...``). The exit status is 1 when any run failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTED_TESTS = (
    "packages/swap-core/tests/test_dtensor.py",
    "packages/swap-core/tests/test_distributed_teardown.py",
    "packages/swap-core/tests/test_prefetch_backward_fsdp2.py",
    "packages/swap-core/tests/test_step_in_backward_fsdp2.py",
    "packages/swap-muon/tests/test_distributed_muon.py",
    "packages/swap-ckpt/tests",
    "integration-tests/test_ckpt_torchrun.py",
)


def busy_loop() -> None:
    """Keep one core busy until killed."""
    while True:
        pass


def run_once(targets: list[str], log: Path, workers: int) -> tuple[int, float]:
    """One ``pytest -m distributed`` over ``targets`` (with ``workers`` pytest-xdist workers unless 0); its output
    goes to ``log``. Returns (status, seconds)."""
    command = [sys.executable, "-m", "pytest", "-m", "distributed", "-q", "-p", "no:cacheprovider", *targets]
    if workers:
        command += ["-n", str(workers), "--dist", "worksteal"]
    started = time.monotonic()
    with log.open("w") as output:
        status = subprocess.run(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, check=False).returncode
    return status, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "targets", nargs="*", help=f"test files or directories (default: {' '.join(DISTRIBUTED_TESTS)})"
    )
    parser.add_argument("--runs", type=int, default=30, help="consecutive runs (default 30)")
    parser.add_argument("--load", type=int, default=1, help="busy-looping processes beside the tests (default 1)")
    parser.add_argument(
        "--workers", type=int, default=0, help="pytest-xdist workers, so that worlds run side by side (default 0: none)"
    )
    parser.add_argument("--logs", type=Path, default=ROOT / "out" / "stress", help="where failed runs' logs go")
    args = parser.parse_args()
    if args.runs < 1 or args.load < 0 or args.workers < 0:
        parser.error(
            f"--runs must be >= 1, --load and --workers >= 0, got --runs {args.runs} --load {args.load} "
            f"--workers {args.workers}"
        )
    targets = args.targets or [target for target in DISTRIBUTED_TESTS if (ROOT / target).exists()]
    args.logs.mkdir(parents=True, exist_ok=True)

    load = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(args.load)]
    for process in load:
        process.start()
    failed: list[int] = []
    try:
        for run in range(1, args.runs + 1):
            log = args.logs / f"run-{run:03d}.log"
            status, seconds = run_once(targets, log, args.workers)
            if status == 0:
                log.unlink()
            else:
                failed.append(run)
            verdict = "ok" if status == 0 else f"FAILED (exit {status}, log {log})"
            print(f"run {run}/{args.runs}: {verdict} in {seconds:.0f} s; failed so far {len(failed)}", flush=True)
    finally:
        for process in load:
            process.kill()
    workers = f"{args.workers} pytest-xdist workers, " if args.workers else ""
    print(f"{len(failed)} of {args.runs} runs failed ({workers}{args.load} busy process(es), {os.cpu_count()} cores)")
    if failed:
        print("failed runs: " + ", ".join(map(str, failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
