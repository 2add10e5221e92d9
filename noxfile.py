"""The one task runner of the swap monorepo.

``nox`` runs lint, typecheck, tests (one session per package), integration, device_perf_dry_run (the GPU speed script
tools/device-perf.sh on the simulator), kernels (the tests comparing figures with docs, under torch's portable CPU
kernels), docs, docs_snippets (every Python snippet of README.md and docs/), build (wheels and sdists, checked) and
install_matrix (fresh environments installing subsets of the built wheels).
``nox -s demo`` trains a small GPT with plain and swapped AdamW and plots it (examples/train_gpt.py), ``nox -s
demo_bf16`` the same GPT in bf16 with and without master weights (examples/train_gpt_bf16.py);
``nox -s thirdparty`` checks swap-generic over third-party optimizers, ``nox -s integrations`` the
training-framework recipes (both download packages); ``nox -l`` lists every session.
Arguments after ``--`` reach the tool, e.g. ``nox -s "tests(package='swap-core')" -- --backend cuda``.

torch is pinned in exactly one place (``TORCH`` below) and installed with pip before
anything else in every session that needs it: an unpinned torch, or a range that admits a
newer release, pulls a CUDA build of several GB. Override it with ``SWAP_TORCH_SPEC``
(e.g. ``SWAP_TORCH_SPEC="torch==2.13.0" nox``, or a spec plus index options for an
accelerator build).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
PACKAGES_DIR = ROOT / "packages"
INTEGRATION_DIR = ROOT / "integration-tests"
RECIPES_DIR = INTEGRATION_DIR / "recipes"

TORCH = os.environ.get("SWAP_TORCH_SPEC", "torch==2.13.0")
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"
# expecttest: torch's OptimizerInfo database imports it.
TEST_TOOLS = ("pytest>=8", "pytest-xdist>=3.6", "hypothesis>=6", "expecttest")
TEST_WORKERS = ("-n", os.environ.get("SWAP_TEST_WORKERS", "auto"), "--dist", "worksteal")
"""pytest-xdist arguments of the test sessions: one worker per CPU (``SWAP_TEST_WORKERS=0``: one process, as
``-- -n 0`` does); a worker that runs out of tests takes queued ones from the other, so a long distributed test
does not leave a core idle. Measured here (2 cores): the six suites in 575 s instead of about 1,020 s."""
DOCS_TOOLS = ("mkdocs==1.6.1", "mkdocs-material==9.8.2", "mkdocstrings==1.0.8", "mkdocstrings-python==2.0.11")
PLOT_TOOLS = ("matplotlib",)  # examples/train_gpt.py writes PNG plots
RELEASE_TOOLS = ("build", "twine", "packaging", "tomli; python_version < '3.11'")
BUILD_BACKEND = "hatchling>=1.27"
"""Every package's ``build-system.requires`` (tools/check_release.py checks they agree)."""
EDITABLE_BUILD_TOOLS = (BUILD_BACKEND, "editables~=0.3")
"""What an editable install builds with: hatchling and what its ``get_requires_for_build_editable`` asks for."""
DIST_DIR = ROOT / "dist"

CORE_PACKAGE = "swap-core"
LINT_TARGETS = ("packages", "integration-tests", "examples", "tools", "noxfile.py", "conftest.py")

nox.needs_version = ">=2024.3.2"  # nox.options.reuse_venv, CommandFailed.return_code
nox.options.sessions = [
    "lint",
    "typecheck",
    "tests",
    "integration",
    "device_perf_dry_run",
    "kernels(kernels='default')",
    "docs",
    "docs_snippets",
    "build",
    "install_matrix",
]
nox.options.reuse_venv = "yes"  # local speed; CI runs a clean clone, so its sessions start fresh


def discover_packages() -> list[str]:
    """Package directories under packages/ (each holds a pyproject.toml), swap-core first.

    A package's distribution name is its directory name (``packages/swap-adam`` ->
    ``swap-adam``); the rest follow in alphabetical order, which is also their install order.
    """
    names = sorted(path.parent.name for path in PACKAGES_DIR.glob("*/pyproject.toml"))
    if CORE_PACKAGE in names:
        names.remove(CORE_PACKAGE)
        names.insert(0, CORE_PACKAGE)
    return names


PACKAGES = discover_packages()

INSTALL_MATRIX = [
    combo
    for combo in (
        ("swap-core",),
        ("swap-core", "swap-adam"),
        ("swap-core", "swap-muon"),
        ("swap-core", "swap-generic"),
        ("swap-core", "swap-adam", "swap-ckpt"),
        ("swap-core", "swap-bench"),
        tuple(PACKAGES),
    )
    if set(combo) <= set(PACKAGES)
]
"""What users install together (``pip install swap-core swap-adam``): each set gets a fresh environment."""


def install_torch(session: nox.Session) -> None:
    """Make the pinned torch importable in the session's environment, from one install shared by all sessions.

    torch takes about 0.9 GB installed with its dependencies, and a CI run has 15 environments that import
    it: as 15 copies that was 15 GB of disk, and a CI machine with less free ran out of space. Instead
    torch is installed once per ``TORCH`` spec into ``.nox/_torch/<spec hash>/`` (``pip install --target``)
    and every environment gets a ``.pth`` file naming that directory. pip reads every ``sys.path`` entry, so
    it counts that torch as installed: a package requiring torch installs no other, and ``pip check`` checks
    it. Anything installed into the environment itself comes first on ``sys.path``.

    ``--no-compile``: pip would byte-compile all of torch's ~15,000 modules; Python compiles the ones
    the sessions import on first import instead, into one cache (see ``cache_bytecode``).
    """
    cache_bytecode(session)  # pip's own modules too, from its second run on
    layer = shared_torch(session)
    purelib = session.run("python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", silent=True)
    assert isinstance(purelib, str), "nox returns a command's output when silent"
    (Path(purelib.strip()) / "swap_shared_torch.pth").write_text(f"{layer}\n")


def shared_torch(session: nox.Session) -> Path:
    """The directory holding ``TORCH`` and its dependencies, installed on first use.

    Installed into a staging directory and renamed into place, so an interrupted install leaves no
    half-filled directory behind for the next run to trust.
    """
    layers = ROOT / ".nox" / "_torch"
    layer = layers / hashlib.sha256(TORCH.encode()).hexdigest()[:16]
    if layer.is_dir():
        return layer
    layers.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=layers))
    try:
        session.run("python", "-m", "pip", "install", "--no-compile", "--target", str(staging), *shlex.split(TORCH))
        (staging / "TORCH_SPEC").write_text(TORCH + "\n")
        staging.rename(layer)
    except OSError:
        if not layer.is_dir():  # else another nox run put the same install in place first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return layer


def cache_bytecode(session: nox.Session) -> None:
    """Let the session's Python cache the bytecode it compiles, in one cache under ``.nox`` (never beside the
    sources).

    Where ``PYTHONDONTWRITEBYTECODE`` is set (this machine's images set it), every process would compile
    torch's modules from source again: measured here, ``import torch, torch._dynamo`` takes 15 s each time
    instead of 15 s once and 6 s after, and a CI run starts over 40 processes that import torch (pytest-xdist
    workers, their forkserver, torchrun ranks, smoke tests). The cache mirrors each source's absolute path,
    so sessions share the shared torch's bytecode and never each other's environments'.
    """
    session.env["PYTHONDONTWRITEBYTECODE"] = None  # removed from the environment of the session's commands
    session.env["PYTHONPYCACHEPREFIX"] = str(ROOT / ".nox" / "_pycache")


def install_workspace(session: nox.Session, *tools: str) -> None:
    """Install torch, every package of the monorepo in editable mode (swap-core first), and ``tools``."""
    install_torch(session)
    # numpy: not a torch dependency, but torch warns on import without it.
    session.install(*EDITABLE_BUILD_TOOLS, "numpy", *tools)
    editables: list[str] = []
    for name in PACKAGES:
        editables += ["-e", f"packages/{name}"]
    # With the build backend installed above instead of in an isolated environment per package: measured
    # here, 16 s instead of 40 s for the five packages and the tools, in each of eight sessions.
    session.install("--no-build-isolation", *editables)


def existing(paths: tuple[str, ...]) -> list[str]:
    return [path for path in paths if (ROOT / path).exists()]


def has_test_modules(directory: Path) -> bool:
    return any(directory.rglob("test_*.py")) or any(directory.rglob("*_test.py"))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over all Python code, and the private-name lint (no torch needed).

    tools/check_private_reaches.py fails when a package, test or example uses another package's underscore
    names, or a package names a private torch API outside its compat module.
    """
    session.install(RUFF)
    targets = existing(LINT_TARGETS)
    session.run("ruff", "check", *targets, *session.posargs)
    session.run("ruff", "format", "--check", "--diff", *targets)
    session.run("python", "tools/check_private_reaches.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the src/ trees of all packages, in one run (torch's stubs are analysed once)."""
    install_workspace(session, MYPY, *TEST_TOOLS)
    session.run("mypy", "--strict", *(f"packages/{name}/src" for name in PACKAGES), *session.posargs)


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's test suite; extra arguments go to pytest (e.g. ``-- --backend cuda -k parity``)."""
    install_workspace(session, *TEST_TOOLS)
    session.run("pytest", *TEST_WORKERS, f"packages/{package}/tests", *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """Cross-package tests in integration-tests/ (never published)."""
    if not INTEGRATION_DIR.is_dir() or not has_test_modules(INTEGRATION_DIR):
        # pytest exits 5 ("no tests collected") on a directory without test modules;
        # that is the expected state until the first cross-package test lands.
        session.log("integration-tests/ holds no test modules yet: nothing to run, not running pytest.")
        return
    # matplotlib: test_demo.py runs examples/train_gpt.py, which writes PNG plots.
    install_workspace(session, *TEST_TOOLS, *PLOT_TOOLS)
    try:
        # The recipes need their frameworks installed: ``nox -s integrations`` runs them.
        session.run(
            "pytest", *TEST_WORKERS, "integration-tests", f"--ignore={RECIPES_DIR.relative_to(ROOT)}", *session.posargs
        )
    except nox.command.CommandFailed as failure:
        if getattr(failure, "return_code", None) != 5:
            raise
        # Exit 5 with test modules present means the arguments deselected every test.
        session.log(f"pytest collected no integration tests with arguments {session.posargs!r}; nothing ran.")


@nox.session
def device_perf_dry_run(session: nox.Session) -> None:
    """tools/device-perf.sh on the simulator with tiny sizes: the GPU speed script runs in CI, so it cannot rot.

    The same script, rows and report as on a lent GPU (docs/hardware.md), each row in a process of its own, the
    packages from the editable install instead of wheels; ``--check-parity`` fails it when a swapped row's parameters
    are not bitwise the plain optimizer's. About 30 s on the 2-core CI machine. Arguments after ``--`` go to
    ``swap-bench device-perf``.
    """
    install_workspace(session)
    session.run("bash", "tools/device-perf.sh", "sim", "--check-parity", *session.posargs, external=True)


FIGURE_TESTS = (
    "integration-tests/test_demo.py",
    "packages/swap-bench/tests/test_documented_figures.py",
    "packages/swap-bench/tests/test_iteration_model.py",
    "packages/swap-core/tests/test_step_in_backward.py",
)
"""Modules holding the tests marked ``figures``: those comparing a figure with a doc, a README line or a stored
number (the ``kernels`` session runs only the marked tests of these modules)."""
CPU_KERNELS = ("default", "avx2", "avx512")
"""``ATEN_CPU_CAPABILITY`` values: the CPU kernels torch is made to pick, from the portable ones up."""


@nox.session
@nox.parametrize("kernels", CPU_KERNELS)
def kernels(session: nox.Session, kernels: str) -> None:
    """The tests comparing figures with the docs, with torch's CPU kernels forced (``ATEN_CPU_CAPABILITY``).

    No test may pass only on CPUs that pick the kernels of the machine where a figure was measured (bf16 losses and
    drifts differ by kernel): the tests marked ``figures`` run here.

    Plain ``nox`` runs ``kernels(kernels='default')``, the portable kernels; the tests and integration sessions run
    the same tests with the machine's own choice. A choice this CPU cannot make (``avx512`` without AVX-512) is
    skipped, saying what torch chose instead."""
    install_workspace(session, *TEST_TOOLS, *PLOT_TOOLS)
    forced = {"ATEN_CPU_CAPABILITY": kernels}
    chosen = session.run(
        "python", "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())", env=forced, silent=True
    )
    assert isinstance(chosen, str), "nox returns a command's output when silent"
    if chosen.strip().lower() != kernels:
        session.skip(f"torch cannot run its {kernels!r} CPU kernels here: it chose {chosen.strip()!r}")
    session.run("pytest", *TEST_WORKERS, "-m", "figures", *FIGURE_TESTS, *session.posargs, env=forced)


DOCS_SNIPPET_TOOLS = ("pytest-markdown-docs==0.9.2",)


@nox.session
def docs_snippets(session: nox.Session) -> None:
    """Every Python snippet of README.md and docs/, run by pytest-markdown-docs.

    From a scratch folder, so that files a snippet writes stay out of the checkout. A snippet fenced
    ``{.python notest}`` is not run: it needs a torchrun launch or a framework ``nox -s integrations`` installs.
    The names snippets take as given (``model``, ``params``, ``loader``...) come from the root conftest.py."""
    install_workspace(session, *TEST_TOOLS, *DOCS_SNIPPET_TOOLS)
    scratch = Path(session.create_tmp()) / "snippets"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    session.chdir(scratch)
    session.run(
        "pytest",
        "--rootdir",
        str(ROOT),
        "-c",
        str(ROOT / "pyproject.toml"),
        "-p",
        "no:cacheprovider",
        "--markdown-docs",
        "--markdown-docs-syntax=superfences",
        "-m",
        "markdown-docs",
        str(ROOT / "README.md"),
        str(ROOT / "docs"),
        *session.posargs,
    )


@nox.session
def docs(session: nox.Session) -> None:
    """Every public name documented, and the mkdocs site built with --strict.

    Broken links, pages missing from nav, API reference pages that cannot be generated, and a Sphinx role shown
    as text (tools/check_built_docs.py) fail."""
    session.install(*DOCS_TOOLS)
    session.run("python", "tools/check_api_docs.py")
    site_dir = Path(session.create_tmp()) / "site"
    session.run("mkdocs", "build", "--strict", "--site-dir", str(site_dir), env={"NO_MKDOCS_2_WARNING": "1"})
    session.run("python", "tools/check_built_docs.py", str(site_dir))


def build_distributions(session: nox.Session, *, wheel_only: bool = False) -> list[Path]:
    """Build every package into dist/ (afresh) with ``python -m build``; the wheels built."""
    session.install(*RELEASE_TOOLS)
    shutil.rmtree(DIST_DIR, ignore_errors=True)
    for name in PACKAGES:
        session.run(
            "python", "-m", "build", *(["--wheel"] if wheel_only else []), "--outdir", str(DIST_DIR), f"packages/{name}"
        )
    return sorted(DIST_DIR.glob("*.whl"))


@nox.session
def build(session: nox.Session) -> None:
    """Wheels and sdists of every package into dist/, checked by twine and tools/check_release.py.

    ``twine check --strict``; check_release: versions match the CHANGELOGs, wheel requirements match the imports,
    sibling pins admit the siblings."""
    build_distributions(session)
    session.run("twine", "check", "--strict", *sorted(str(path) for path in DIST_DIR.iterdir()))
    session.run("python", "tools/check_release.py", str(DIST_DIR), "--build-backend", BUILD_BACKEND)


@nox.session
@nox.parametrize("combo", [",".join(combo) for combo in INSTALL_MATRIX], ids=["+".join(c) for c in INSTALL_MATRIX])
def install_matrix(session: nox.Session, combo: str) -> None:
    """A fresh environment with torch and some of the built wheels (never editable), smoke-tested.

    Uses dist/'s wheels when ``build`` made them in this run, else builds them.
    """
    names = combo.split(",")
    wheels = {path.name.split("-")[0]: path for path in DIST_DIR.glob("*.whl")}
    if not all(name.replace("-", "_") in wheels for name in names):
        wheels = {path.name.split("-")[0]: path for path in build_distributions(session, wheel_only=True)}
    install_torch(session)
    chosen = [str(wheels[name.replace("-", "_")]) for name in names]
    session.install(*chosen)  # their dependencies (rich) from the index, torch as installed above
    session.install("--force-reinstall", "--no-deps", *chosen)  # a reused environment gets these very wheels
    session.run("python", "-m", "pip", "check")
    session.run("python", "tools/smoke_install.py", *names)


def install_with_pinned_torch(session: nox.Session, *packages: str) -> None:
    """pip-install ``packages`` under a constraint holding the pinned torch (a package asking for torch
    must not replace it with another build)."""
    constraints = Path(session.create_tmp()) / "torch-constraints.txt"
    constraints.write_text("\n".join(arg for arg in shlex.split(TORCH) if not arg.startswith("-")) + "\n")
    session.install("-c", str(constraints), *packages)


THIRD_PARTY_OPTIMIZERS = ("bitsandbytes", "lion-pytorch", "schedulefree", "torchao", "transformers")
"""Third-party optimizer packages swap-generic is checked against (``nox -s thirdparty``)."""


@nox.session
def thirdparty(session: nox.Session) -> None:
    """swap-generic over third-party optimizers (downloads them: not in plain nox).

    bitsandbytes, lion-pytorch, schedule-free, torchao and transformers, installed under a constraint holding the
    pinned torch; a test whose package is absent is skipped with the reason."""
    install_workspace(session, *TEST_TOOLS)
    install_with_pinned_torch(session, *THIRD_PARTY_OPTIMIZERS)
    session.run("pytest", "packages/swap-generic/tests/test_generic_thirdparty.py", "-rs", *session.posargs)


TRAINING_FRAMEWORKS = (
    "transformers==5.24.0",
    "accelerate==1.15.0",
    "pytorch-lightning==2.6.6",
    "torchtune==0.6.1",
    "torchao==0.14.1",  # torchtune 0.6.1 imports torchao.dtypes.nf4tensor, which torchao 0.15 removed
    "torchtitan==0.3.0",
)
"""The frameworks of docs/integrations.md's recipes, at the versions the recipes were checked against."""


@nox.session
def integrations(session: nox.Session) -> None:
    """The training-framework recipes of docs/integrations.md (downloads them: not in plain nox).

    examples/integrations/ under Hugging Face Trainer, Lightning, torchtune and torchtitan; a recipe whose
    framework is absent is skipped with the reason."""
    install_workspace(session, *TEST_TOOLS)
    install_with_pinned_torch(session, *TRAINING_FRAMEWORKS)
    session.run("pytest", str(RECIPES_DIR.relative_to(ROOT)), "-rs", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """Train a small GPT with plain and swapped AdamW, check parity, plot; arguments go to examples/train_gpt.py.

    ``nox -s demo -- --quick`` runs 20 steps; the plots and summary.json land in out/demo/.
    """
    install_workspace(session, *PLOT_TOOLS)
    session.run("python", "examples/train_gpt.py", *session.posargs)


@nox.session
def demo_bf16(session: nox.Session) -> None:
    """The GPT in bf16: plain AdamW, fp32 masters, and swapped with master_weights=True.

    The swapped run must be bitwise the fp32-master one; arguments go to examples/train_gpt_bf16.py
    (``-- --quick``: 20 steps)."""
    install_workspace(session, *PLOT_TOOLS)
    session.run("python", "examples/train_gpt_bf16.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """swap-bench: swapped vs unswapped optimizer and the raw link, measured in one run (``-- --quick``)."""
    install_workspace(session)
    session.run("swap-bench", *session.posargs)
