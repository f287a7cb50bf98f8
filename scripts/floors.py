"""The floors check: berth's tests in a venv holding every runtime dependency
at exactly the floor pyproject.toml sets for it.

    python scripts/floors.py torch==2.13.0        # what `make floors` runs
    python scripts/floors.py torch==2.13.0 tests/test_e2e.py   # other tests

Steps, each printed as it starts:

1. The floors: every requirement of ``[project] dependencies`` whose marker
   holds here, pinned at its ``>=`` bound. torch is the exception: the one
   given on the command line (the Makefile's CPU build) is installed instead,
   because torch's floor cannot be installed on a CPU machine from PyPI
   without pulling a multi-GB CUDA build.
2. What the floors pull: pip resolves torch and the floors alone
   (``--dry-run --report``) and names every package of that closure.
3. The constraints: the floors, exactly; the build requirements and the dev
   extra at constraints.txt's pins, except those the floors pull themselves
   (opentelemetry-proto, transformers: their versions follow the floors);
   nothing else, so pip picks what the floors admit. A dev tool that needs a
   runtime dependency above its floor makes pip's resolver fail, and this
   script with it: raise that floor.
4. A new venv (``build/floors-venv``, never ``.venv``), a copy of the working
   tree (``build/floors-src``), berth built from the copy in the venv
   (``--no-build-isolation``: the stubs and the Cython core come from the
   venv's grpcio-tools and Cython), the default models built into
   ``build/floors-models`` by that berth.
5. pytest on the copy: the tests named on the command line, else
   ``DEFAULT_TESTS``.

Exits with pytest's status, or 1 when an install fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
VENV = BUILD / "floors-venv"
SOURCE = BUILD / "floors-src"
MODELS = BUILD / "floors-models"
CONSTRAINTS = BUILD / "floors-constraints.txt"
# The suite's serving, batching, engine, tracing and HTTP tests: what the
# runtime dependencies are used by, and about 10 minutes on 2 cores.
DEFAULT_TESTS = [
    "tests/gateway",
    "tests/batcher",
    "tests/services",
    "tests/engine",
    "tests/test_e2e.py",
    "tests/test_rerank.py",
    "tests/test_fallback.py",
    "tests/test_observability.py",
    "tests/test_onnx.py",
]


def step(message: str) -> None:
    print(f"\n== {message}", flush=True)


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def floors() -> dict[str, Version]:
    """name -> floor of every runtime requirement that applies here (not torch)."""
    found = {}
    for raw in project()["dependencies"]:
        req = Requirement(raw)
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
        if not lows:
            raise SystemExit(f"{raw}: no >= floor to install")
        if name != "torch":
            found[name] = max(lows)
    return found


def pins() -> dict[str, str]:
    """constraints.txt as name -> version."""
    found = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            found[canonicalize_name(name)] = version
    return found


def pip(python: Path, *args: str | Path, quiet: bool = True) -> None:
    command = [python, "-m", "pip", *args]
    if quiet:
        command.insert(3, "-q")
    if subprocess.run(command).returncode != 0:
        raise SystemExit(f"pip failed: {' '.join(map(str, args))}")


def closure(python: Path, torch: str, low: dict[str, Version]) -> set[str]:
    """The names of everything torch and the floors pull, from nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pins_file = Path(tmp) / "floors.txt"
        pins_file.write_text("".join(f"{n}=={v}\n" for n, v in low.items()))
        pip(
            *(python, "install", "--dry-run", "--ignore-installed"),
            *("--report", report, torch, "-r", pins_file),
        )
        installs = json.loads(report.read_text())["install"]
    return {canonicalize_name(item["metadata"]["name"]) for item in installs}


def constraints(low: dict[str, Version], pulled: set[str]) -> str:
    """The floors, exactly; the build requirements and the dev extra at
    constraints.txt's pins, except those the floors pull themselves (their
    versions follow the floors: opentelemetry-proto follows the exporter's).
    Nothing else is constrained: pip picks what the floors admit."""
    tools = {
        canonicalize_name(Requirement(raw).name)
        for raw in [*build_requires(), *project()["optional-dependencies"]["dev"]]
    }
    pinned = pins()
    held = {n: str(v) for n, v in low.items()}
    held |= {n: pinned[n] for n in sorted(tools - pulled - set(low))}
    return "".join(f"{n}=={v}\n" for n, v in sorted(held.items()))


def copy_tree(dest: Path) -> None:
    """The working tree as it is (edits included), without ignored files:
    the build writes its stubs and its Cython core into the copy."""
    shutil.rmtree(dest, ignore_errors=True)
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        source = ROOT / raw.decode()
        if source.is_file():
            target = dest / raw.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def install(torch: str, low: dict[str, Version]) -> Path:
    """The floors venv with berth built from the copy; its python."""
    python = VENV / "bin" / "python"
    step(f"new venv {VENV.relative_to(ROOT)}")
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    pip(python, "install", "-c", ROOT / "constraints.txt", "--upgrade", "pip")
    step("resolving what torch and the floors pull")
    CONSTRAINTS.write_text(constraints(low, closure(python, torch, low)))
    step(f"installing {torch}, the floors, the build requirements, the dev extra")
    print(f"  constraints: {CONSTRAINTS.relative_to(ROOT)}", flush=True)
    requirements = [*project()["dependencies"], *build_requires()]
    dev = project()["optional-dependencies"]["dev"]
    try:
        pip(python, "install", "-c", CONSTRAINTS, torch, *requirements, *dev)
    except SystemExit:
        print(
            "a build requirement or dev tool needs a runtime dependency above "
            "its floor (pip names them above): raise that floor",
            file=sys.stderr,
        )
        raise
    step(f"building berth from a copy of the tree ({SOURCE.relative_to(ROOT)})")
    build(python)
    return python


def build(python: Path) -> None:
    copy_tree(SOURCE)
    pip(python, "install", "--no-deps", "--no-build-isolation", "-e", SOURCE)


def build_requires() -> list[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(pyproject["build-system"]["requires"])


def report(python: Path, low: dict[str, Version]) -> None:
    """Print the floors next to what the venv holds; fail where they differ."""
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format", "json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    have = {canonicalize_name(d["name"]): d["version"] for d in json.loads(listed)}
    step("the floors installed")
    width = max(map(len, low))
    for name in sorted(low):
        print(f"  {name:<{width}}  {have.get(name, '-')}")
    print(f"  {'torch':<{width}}  {have.get('torch', '-')}")
    wrong = [n for n, v in low.items() if Version(have.get(n, "0")) != v]
    if wrong:
        raise SystemExit(f"not at their floors: {', '.join(sorted(wrong))}")


def models(python: Path) -> None:
    """The default models, built by the floors' berth (scikit-learn, joblib)."""
    step(f"building the default models into {MODELS.relative_to(ROOT)}")
    berth = python.parent / "berth"
    subprocess.run([berth, "build-models", "--model-repository", MODELS], check=True)


def pytest(python: Path, tests: list[str]) -> int:
    step(f"pytest {' '.join(tests)}")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "BERTH_MODEL_REPOSITORY": str(MODELS),
        "PYTHONPATH": str(SOURCE),
    }
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    return subprocess.run([*command, *tests], cwd=SOURCE, env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("torch", help="the torch to install, as torch==X.Y.Z")
    parser.add_argument("tests", nargs="*", default=DEFAULT_TESTS)
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep build/floors-venv and build/floors-models as they are",
    )
    args = parser.parse_args()
    started = time.monotonic()
    low = floors()
    step("the floors, from pyproject.toml")
    print("  " + ", ".join(f"{n}=={v}" for n, v in sorted(low.items())))
    python = VENV / "bin" / "python"
    if args.reuse and python.exists():
        build(python)
    else:
        python = install(args.torch, low)
        shutil.rmtree(MODELS, ignore_errors=True)
    report(python, low)
    models(python)
    status = pytest(python, args.tests)
    step(f"pytest exited {status}; {time.monotonic() - started:.0f} s in all")
    return status


if __name__ == "__main__":
    sys.exit(main())
