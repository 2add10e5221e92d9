"""Smoke-test an installation of swap packages from their wheels: what is installed works, the rest is named.

Run in a fresh environment holding torch and some of the wheels (``nox -s install_matrix`` does)::

    python tools/smoke_install.py swap-core swap-adam

with the distributions that were installed. It checks that

- exactly those swap distributions are installed, from wheels (not editable);
- the adapter entry points of the installed families (and only those) are found, and each installed
  family swaps two steps on the simulator bitwise equal to the plain optimizer;
- an optimizer of a family that is not installed is swapped by swap-generic when that is installed
  (bitwise too), and otherwise raises ``AdapterNotFoundError`` naming the package to install
  (``pip install --find-links dist swap-core swap-adam``), before anything changes;
- swap-core requires torch only; swap-ckpt imports only when installed; the ``swap-bench`` script exists
  only when swap-bench is installed, and then runs a quick benchmark on the simulator whose JSON report
  holds a measured row (swap-core's RMSprop) and, without swap-adam, a skipped AdamW row naming it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

FAMILIES: dict[str, tuple[str, tuple[tuple[str, dict[str, float]], ...]]] = {
    # distribution -> (its entry-point name, torch.optim classes of its family with options that keep a state)
    "swap-core": ("rmsprop", (("RMSprop", {}),)),
    "swap-adam": ("adam", (("AdamW", {}),)),
    "swap-muon": ("muon", (("Muon", {}),)),
    "swap-generic": ("generic", (("SGD", {"momentum": 0.9}), ("NAdam", {}))),
}
GENERIC = "swap-generic"
"""Serves every optimizer whose dedicated family is not installed."""
OTHERS = ("swap-ckpt", "swap-bench")
BENCH = "swap-bench"


def check(installed: list[str]) -> list[str]:
    problems: list[str] = []
    present = {dist.metadata["Name"] for dist in importlib.metadata.distributions() if dist.metadata["Name"]}
    swap_dists = sorted(name for name in present if name.startswith("swap-") or name.startswith("swap_"))
    if sorted(installed) != swap_dists:
        problems.append(f"installed swap distributions are {swap_dists}, expected {sorted(installed)}")
    for name in sorted(set(installed) & set(swap_dists)):
        dist = importlib.metadata.distribution(name)
        direct_url = dist.read_text("direct_url.json")
        if direct_url and json.loads(direct_url).get("dir_info", {}).get("editable"):
            problems.append(f"{name} is an editable install, not a wheel")
    entry_points = {entry.name for entry in importlib.metadata.entry_points(group="swap_core.adapters")}
    expected = {FAMILIES[name][0] for name in installed if name in FAMILIES}
    if entry_points != expected:
        problems.append(f"adapter entry points {sorted(entry_points)}, expected {sorted(expected)}")
    for name, (_, optimizers) in FAMILIES.items():
        for optimizer_name, options in optimizers:
            problems += _check_family(installed, name, optimizer_name, options)
    for name in OTHERS:
        module = name.replace("-", "_")
        if (importlib.util.find_spec(module) is not None) != (name in installed):
            problems.append(f"{module} importable: {importlib.util.find_spec(module) is not None}, installed: {name}")
    core_requires = [req for req in importlib.metadata.requires("swap-core") or [] if "extra ==" not in req]
    if [re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0] for req in core_requires] != ["torch"]:
        problems.append(f"swap-core requires {core_requires}, expected torch only")
    script = shutil.which("swap-bench", path=str(Path(sys.executable).parent))
    if (script is not None) != (BENCH in installed):
        problems.append(
            f"swap-bench script beside {sys.executable}: {script}, swap-bench installed: {BENCH in installed}"
        )
    if script is not None and BENCH in installed:
        problems += _check_bench(script, installed)
    return problems


def _check_bench(script: str, installed: list[str]) -> list[str]:
    """``swap-bench --quick`` on the simulator: RMSprop measured, AdamW measured or skipped naming swap-adam."""
    with tempfile.TemporaryDirectory() as scratch:
        report_path = Path(scratch) / "bench.json"
        command = [script, "--quick", "--backend", "sim", "--workloads", "few_large"]
        command += ["--optimizers", "rmsprop", "adamw", "--compare", "--json", str(report_path)]
        bench = subprocess.run(command, capture_output=True, text=True, check=False)
        if bench.returncode != 0:
            return [f"swap-bench --quick exited {bench.returncode}: {bench.stderr.strip()[-300:]}"]
        report = json.loads(report_path.read_text())
    measured = {row["optimizer"] for row in report["rows"]}
    skipped = " ".join(row["reason"] for row in report["skipped"])
    problems = []
    if "rmsprop" not in measured:
        problems.append(f"swap-bench measured no RMSprop row: {report['skipped']}")
    if ("adamw" in measured) != ("swap-adam" in installed or GENERIC in installed):
        problems.append(f"swap-bench AdamW rows measured: {'adamw' in measured}, installed: {installed}")
    if "adamw" not in measured and "swap-adam" not in skipped:
        problems.append(f"swap-bench skipped AdamW without naming swap-adam: {skipped}")
    return problems


def _check_family(installed: list[str], name: str, optimizer_name: str, options: dict[str, float]) -> list[str]:
    """One optimizer of family ``name``: swapped bitwise by its package, by swap-generic, or refused naming it."""
    from swap_core import SwapConfig, swap_optimizer
    from swap_core.errors import AdapterNotFoundError

    params = [torch.nn.Parameter(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)))]
    plain_params = [torch.nn.Parameter(params[0].detach().clone())]
    optimizer_cls = getattr(torch.optim, optimizer_name)
    served_by = name if name in installed else GENERIC if GENERIC in installed else None
    if served_by is None:
        before = params[0].detach().clone()
        problems = []
        try:
            swap_optimizer(optimizer_cls(params, lr=1e-2, **options), SwapConfig(backend="sim"))
        except AdapterNotFoundError as error:
            if f"--find-links dist swap-core {name}" not in str(error):
                problems.append(f"{optimizer_name} without {name}: the error does not name it: {error}")
        else:
            problems.append(f"{optimizer_name} was swapped although neither {name} nor {GENERIC} is installed")
        if not torch.equal(before, params[0]):
            problems.append(f"{optimizer_name}: the refused wrap changed the parameter")
        return problems
    try:
        config = SwapConfig(backend="sim", min_numel=16)
        swapped = swap_optimizer(optimizer_cls(params, lr=1e-2, **options), config)
    except AdapterNotFoundError as error:
        return [f"{optimizer_name} is not swapped although {served_by} is installed: {error}"]
    problems = []
    adapter = type(swapped.adapter).__name__
    if (served_by == GENERIC) != (adapter == "GenericAdapter"):
        problems.append(f"{optimizer_name} is served by {adapter}, expected the adapter of {served_by}")
    plain = optimizer_cls(plain_params, lr=1e-2, **options)
    for optimizer, group in ((swapped, params), (plain, plain_params)):
        for step in range(2):  # the first step creates the states; the second one streams them
            group[0].grad = torch.randn(64, 32, generator=torch.Generator().manual_seed(1 + step))
            optimizer.step()
    if not torch.equal(params[0].detach(), plain_params[0].detach()):
        problems.append(f"{optimizer_name} through {served_by}: the swapped steps differ from the plain ones")
    if swapped.stats.h2d_bytes == 0:
        problems.append(f"{optimizer_name} through {served_by}: nothing was swapped")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("installed", nargs="+", help="the swap distributions that were installed")
    args = parser.parse_args()
    problems = check(args.installed)
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    if not problems:
        print(f"ok: {' + '.join(args.installed)} installed from wheels work, the missing families are named")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
