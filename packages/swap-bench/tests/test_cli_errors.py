"""A user's mistake on swap-bench's command lines: one ``error:`` line, exit status 2, before any work starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swap_bench import main


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()
    assert message[-1].startswith("swap-bench"), message
    assert "Traceback" not in "\n".join(message)
    return message[-1]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--threads", "0"], "argument --threads: must be an integer >= 1, got 0"),
        (["--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
        (["--warmup", "-1"], "argument --warmup: must be an integer >= 0, got -1"),
        (["--repeats", "two"], "argument --repeats: must be an integer, got 'two'"),
        (["plan", "--tables", "--swap-times", "0"], "argument --swap-times: must be an integer >= 1, got 0"),
        (["plan", "--tables", "--world", "0"], "argument --world: must be an integer >= 1, got 0"),
        (["plan", "--tables", "--ranks-per-node", "0"], "argument --ranks-per-node: must be an integer >= 1, got 0"),
        (["plan", "--tables", "--rank", "-1"], "argument --rank: must be an integer >= 0, got -1"),
        (["plan", "--tables", "--world", "4", "--rank", "4"], "--rank must be in [0, 4) for --world 4, got 4"),
        (["narrowing", "--batches", "0"], "argument --batches: must be an integer >= 1, got 0"),
        (["narrowing", "--threads", "0"], "argument --threads: must be an integer >= 1, got 0"),
        (["device-perf", "--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
        (["device-perf", "--budget-s", "0"], "argument --budget-s: must be an integer >= 1, got 0"),
        (["device-perf", "--device-memory", "lots"], "argument --device-memory: must be a size such as 80GB"),
    ],
)
def test_a_count_that_cannot_be_is_an_error_line(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert words in _error(argv, capsys)


@pytest.mark.parametrize(
    "command",
    [[], ["plan", "--tables"], ["narrowing"], ["device-perf"]],
    ids=["bench", "plan-tables", "narrowing", "device-perf"],
)
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "is a directory" in _error([*command, "--json", str(tmp_path)], capsys)
    missing = tmp_path / "no" / "such" / "folder" / "report.json"
    assert "does not exist; create it first" in _error([*command, "--json", str(missing)], capsys)
    if command == ["plan", "--tables"]:
        assert "is a directory" in _error([*command, "--markdown", str(tmp_path)], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
@pytest.mark.parametrize("command", [[], ["device-perf"]], ids=["bench", "device-perf"])
def test_an_accelerator_this_build_lacks_is_one_line(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    line = _error([*command, "--backend", "cuda"], capsys)
    assert "--backend cuda: torch" in line and "has no usable cuda device here (use --backend sim, or auto)" in line
