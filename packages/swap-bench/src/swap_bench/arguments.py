"""Argument types shared by swap-bench's commands: a user's mistake is an ``error:`` line and exit status 2.

argparse turns a type function's ``ArgumentTypeError`` into its usual ``usage: ... error: argument --x: ...``
line, before any work starts: a count that cannot be (``--repeats 0``, ``--swap-times 0``) and an output file that
cannot be written (a directory, a missing or read-only folder) are refused there, not after a long run.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .models import MODELS, ModelShape

__all__ = [
    "HelpFormatter",
    "byte_size",
    "command_parser",
    "count",
    "fraction",
    "model_argument",
    "output_file",
    "positive_count",
    "staging_count",
]


def positive_count(text: str) -> int:
    """An int >= 1 (repeats, threads, batches, world sizes)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def staging_count(text: str) -> int:
    """An int >= 2 (``SwapConfig.staging_buffers``)."""
    value = _int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2, got {text}")
    return value


def count(text: str) -> int:
    """An int >= 0 (warm-up steps)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A float in (0, 1] (a share of a peak)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default after its help (where it has one: not for a switch, nor where the help says it), and
    descriptions kept as written (their own line breaks)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def byte_size(text: str) -> int:
    """A number of bytes >= 1, with an optional unit: ``80GB`` (10^9), ``80GiB`` (2^30), ``512MB``, ``4096``."""
    stripped = text.strip().replace(" ", "").upper()
    digits = stripped.rstrip("BKMGTI")
    unit = stripped[len(digits) :] or "B"
    try:
        value = float(digits)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a size such as 80GB, 80GiB or 512MB, got {text!r}") from None
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"unknown unit {unit!r} in {text!r}; use one of {', '.join(_UNITS)}")
    size = int(value * _UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text}")
    return size


def output_file(text: str) -> str:
    """A file path that can be written: not a directory, in an existing folder this process may write into."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name (e.g. {path / 'report.json'})")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {folder} does not exist; create it first")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text} cannot be written (permission denied)")
    if not path.exists() and not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot create files in {folder} (permission denied)")
    return text


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The parser of one swap-bench command, its help laid out by :class:`HelpFormatter`. Options are taken whole
    (``--swap-time`` is not ``--swap-times``): a command line in a script or the docs means what it says."""
    return argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter, description=description, allow_abbrev=False
    )


def model_argument(name: str, parser: argparse.ArgumentParser) -> ModelShape:
    """``--model NAME``: a preset of :data:`~swap_bench.models.MODELS`, or a Llama-style Hugging Face config.json
    (the parser exits naming the value otherwise)."""
    if name in MODELS:
        return MODELS[name]
    if Path(name).is_file():
        try:
            return ModelShape.from_config_json(name)
        except ValueError as error:
            parser.error(str(error))
    parser.error(f"--model {name!r} is neither a preset ({', '.join(MODELS)}) nor a config.json file")
