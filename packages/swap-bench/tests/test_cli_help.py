"""``swap-bench --help`` and its subcommands' help: every flag explained, and its default shown.

A switch (off unless given) and an optional output or limit (nothing unless given) have no default to show; each
is listed here with what its absence means, so that a new flag without a shown default fails until it is listed.
"""

from __future__ import annotations

import re

import pytest

from swap_bench.cli import main

WITHOUT_A_SHOWN_DEFAULT = {
    "": {"--quick": "switch", "--system-allocator": "switch"},
    "plan": {
        "--tables": "switch",
        "--host-memory": "the host memory is not checked",
        "--fp32": "switch",
        "--activation-checkpointing": "switch",
        "--no-iterations": "switch",
    },
    "plan --tables": {
        "--device-memory": "no recommendation of a batch count",
        "--master-weights": "switch",
        "--markdown": "no Markdown table",
        "--tokens": "no whole-iteration rows",
    },
    "narrowing": {"--quick": "switch"},
    "device-perf": {"--check-parity": "switch"},
}


def _options(command: str, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """Each flag of ``command``'s help with its help text."""
    with pytest.raises(SystemExit) as exit_info:
        main([*command.split(), "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out.split("options:", 1)[1]
    blocks = [block.strip() for block in re.split(r"\n(?=  -)", text) if block.strip()]
    options: dict[str, str] = {}
    for block in blocks:
        flag, *words = block.split()
        while words and (words[0].isupper() or words[0].startswith(("{", "[", "..."))):  # the metavar
            words.pop(0)
        options[flag.rstrip(",")] = " ".join(words)
    return options


@pytest.mark.parametrize("command", sorted(WITHOUT_A_SHOWN_DEFAULT), ids=lambda command: command or "measure")
def test_every_flag_is_explained_and_shows_its_default(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    options = _options(command, capsys)
    exempt = WITHOUT_A_SHOWN_DEFAULT[command]
    assert set(exempt) <= set(options), f"listed here but gone from the help: {sorted(set(exempt) - set(options))}"
    for flag, help_text in options.items():
        if flag == "-h":
            continue
        assert help_text, f"swap-bench {command} {flag} has no help"
        if flag not in exempt:
            assert "(default:" in help_text, f"swap-bench {command} {flag} does not show its default: {help_text!r}"
