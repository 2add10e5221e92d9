"""examples/colocated_rl.py as a user runs it: the swapped trainer leaves nothing on the device between steps and
moves nothing outside ``step()``, bitwise the plain loop; docs/colocated-rl.md shows its output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("swap_adam")

ROOT = Path(__file__).resolve().parents[1]


def test_the_swapped_trainer_needs_no_offload_and_the_page_shows_the_run() -> None:
    script = ROOT / "examples" / "colocated_rl.py"
    completed = subprocess.run(
        [sys.executable, "-W", "error", str(script)], capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    output = completed.stdout
    state = 2 * 8 * 512 * 512 * 4  # AdamW's two fp32 moments of eight 512 x 512 weights
    swapped = output.split("AdamW swapped", 1)[1]
    assert "moved outside step() (offload + reload):          0 B" in swapped
    assert f"moved inside step(), overlapped with the update:  {2 * 5 * state:,} B" in swapped
    assert f"optimizer state on the device at the step's peak: {state // 4:,} B" in swapped  # 2 of 8 batches
    assert "optimizer state on the device during the rollouts: 0 B" in swapped
    plain = output.split("AdamW swapped", 1)[0]
    assert f"moved outside step() (offload + reload):          {2 * 5 * state:,} B" in plain
    assert "parameters bitwise equal after 5 rounds: True" in output
    page = (ROOT / "docs" / "colocated-rl.md").read_text()
    for line in output.splitlines():
        assert line in page, f"docs/colocated-rl.md should show the line {line!r}"
