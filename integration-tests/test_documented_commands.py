"""Every shell command that README.md and docs/ show works as written, or is marked for why CI does not run it.

The commands are read from the ``bash`` fences (continuation lines joined, ``&&`` chains split, comments cut).
Each one falls under exactly one rule below, or the test fails naming it:

- ``swap-bench`` commands run here (a temporary directory, reports written there), unless listed in
  :data:`LONG_RUNS`, which are parsed with the command's own parser (every option must exist and take its
  value) but not run: they model or measure for minutes;
- a line with ``...`` or ``[option]`` is a template, not a command: its ``swap-bench`` part is parsed without the
  placeholders;
- ``nox`` commands name a session of noxfile.py (CI runs ``nox`` itself);
- ``pip install`` names distributions this repository builds, paths into it, or torch at the pinned version;
- ``--backend cuda``/``npu`` and ``tools/device-check.sh`` need a GPU (docs/hardware.md): the script and its
  sub-command must exist, and the command is not run.
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from swap_bench.cli import parse_command

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
FENCE = re.compile(r"^```(?:bash|shell|sh|console)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)

LONG_RUNS = {
    "swap-bench": "measures every workload with each optimizer, nine repeats: minutes (nox -s bench runs it)",
    "swap-bench --backend sim --optimizers adamw --workloads many_small few_large": "measures two workloads: minutes",
    "swap-bench plan --tables --model llama-7b llama-70b --world 8 --link pcie5 pcie5-achievable --ranks-per-node 1 8 "
    "--swap-times 4 --master-weights --json plan.json --markdown plan.md": "models 16 rows of 7B and 70B models",
    "swap-bench narrowing": "times four optimizers over 64 batches, 30 repeats each",
}
"""Documented ``swap-bench`` commands parsed but not run here, and why."""


def documented_commands() -> list[tuple[str, str]]:
    """``(file:line, command)`` of every command in a shell fence of README.md and docs/ (its first line's)."""
    commands = []
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        for fence in FENCE.finditer(text):
            line_number = text[: fence.start()].count("\n") + 1
            pending, started = "", 0
            for line in fence.group(1).splitlines():
                line_number += 1
                if not pending:
                    started = line_number
                if line.rstrip().endswith("\\"):
                    pending += line.rstrip()[:-1] + " "
                    continue
                code = (pending + line).split("  #", 1)[0].split(" # ", 1)[0].strip()
                pending = ""
                if not code or code.startswith("#"):
                    continue
                for command in code.split("&&"):
                    commands.append((f"{document.relative_to(ROOT)}:{started}", " ".join(command.split())))
    return commands


COMMANDS = documented_commands()


def _nox_session_functions() -> dict[str, ast.FunctionDef]:
    """noxfile.py's sessions (functions decorated with ``nox.session``), by name."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    return {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("nox.session" in ast.unparse(decorator) for decorator in node.decorator_list)
    }


def _nox_sessions() -> set[str]:
    """The names of noxfile.py's sessions."""
    return set(_nox_session_functions())


def _pinned_torch() -> str:
    match = re.search(r'"SWAP_TORCH_SPEC", "(torch==[^"]+)"', (ROOT / "noxfile.py").read_text(encoding="utf-8"))
    assert match is not None, "noxfile.py pins torch in one place (TORCH = ...)"
    return match.group(1)


def _needs_gpu(words: list[str]) -> bool:
    return any(words[i : i + 2] in (["--backend", "cuda"], ["--backend", "npu"]) for i in range(len(words)))


def _check_swap_bench(words: list[str], tmp_path: Path, *, template: bool) -> None:
    arguments = words[1:]
    if template:
        arguments = [word.strip("[]") for word in arguments if word != "..."]
    try:
        parse_command(arguments)
    except SystemExit as error:
        raise AssertionError(f"swap-bench refuses the documented options {arguments}") from error
    command = " ".join(words)
    if template or command in LONG_RUNS or _needs_gpu(words):
        return
    # Run as written, in a directory of its own: its reports go there.
    run = subprocess.run(
        [sys.executable, "-m", "swap_bench", *arguments], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, f"`{command}` failed ({run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"


def _check_nox(words: list[str]) -> None:
    sessions = _nox_sessions()
    if "-s" not in words:
        return  # plain `nox`: the default sessions, which CI runs
    name = words[words.index("-s") + 1]
    base = name.split("(", 1)[0]
    assert base in sessions, f"no nox session {base!r} (noxfile.py has {sorted(sessions)})"
    package = re.search(r"package='([^']+)'", name)
    if package is not None:
        assert (ROOT / "packages" / package.group(1)).is_dir(), f"no package {package.group(1)!r} for {name}"


def _check_pip_install(words: list[str]) -> None:
    built = {path.parent.name for path in ROOT.glob("packages/*/pyproject.toml")}
    for requirement in words[words.index("install") + 1 :]:
        if requirement.startswith("./"):
            assert (ROOT / requirement).is_dir(), f"{requirement} is not a directory of this repository"
        elif requirement.startswith("torch"):
            assert requirement == _pinned_torch(), f"torch is pinned as {_pinned_torch()}, the docs say {requirement}"
        else:
            assert requirement in built | {"nox"}, f"{requirement!r} is not built here (packages: {sorted(built)})"


def _check_device_script(words: list[str]) -> None:
    """The script exists and its usage (its opening comment) lists the sub-command."""
    script = ROOT / words[0]
    assert script.is_file(), f"{words[0]} does not exist"
    if len(words) > 1:
        usage = re.findall(rf"^#\s+{re.escape(words[0])}\s+(\S+)", script.read_text(encoding="utf-8"), re.MULTILINE)
        offered = {sub for line in usage for sub in line.split("|")}
        assert words[1] in offered, f"{words[0]} offers {sorted(offered)}, not {words[1]!r}"


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_documented_command_works_as_written(where: str, command: str, tmp_path: Path) -> None:
    template = "..." in command or re.search(r"\[--?[a-z]", command) is not None
    words = shlex.split(command)
    if words[:3] == ["python3", "-m", "pip"]:
        words = ["pip", *words[3:]]
    if words[:3] == ["python3", "-m", "nox"]:
        words = ["nox", *words[3:]]
    if words[0] == "swap-bench":
        _check_swap_bench(words, tmp_path, template=template)
    elif words[0] == "nox":
        _check_nox(words)
    elif words[:2] == ["pip", "install"]:
        _check_pip_install(words)
    elif words[0].startswith("tools/device-check.sh"):
        _check_device_script(words)
    else:
        raise AssertionError(f"{where}: `{command}` is a kind of command this test has no rule for; add one")


def test_every_long_run_is_documented() -> None:
    """A command listed as a long run that the docs no longer show is a stale entry."""
    documented = {command for _, command in COMMANDS}
    assert set(LONG_RUNS) <= documented, f"not in the docs any more: {sorted(set(LONG_RUNS) - documented)}"


def test_nox_lists_every_session_with_a_whole_sentence() -> None:
    """``nox -l`` shows the first line of each session's docstring: it must be a sentence of its own, not the
    start of one cut at the line's end."""
    for name, function in _nox_session_functions().items():
        docstring = ast.get_docstring(function, clean=False)
        assert docstring, f"nox session {name!r} has no docstring for nox -l"
        first = docstring.strip().splitlines()[0].rstrip()
        assert first.endswith("."), f"nox -l cuts session {name!r}'s description: {first!r}"
