"""swap-bench: the swapped optimizer against the unswapped one and against the link, in one run.

Run ``swap-bench --help`` (or ``python -m swap_bench``). Timings are reported, never asserted.
"""

from .cli import main, plan_rows, run_bench

__all__ = ["main", "plan_rows", "run_bench"]
