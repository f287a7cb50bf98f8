"""pyproject.toml's floors and constraints.txt's pins.

The floors must admit nothing the generated stubs refuse at import (their
protobuf gencode version, their GRPC_GENERATED_VERSION) and no release with a
published advisory; constraints.txt must pin every requirement to a version
the floors admit; every install in the Makefile and the Dockerfile must go
through it; and the environment the tests run in must be the pinned one.
Nothing here reaches the network.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
# Wheels only a CUDA build of torch pulls: never pinned (CI has no GPU).
CUDA_ONLY = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")
# The first release past a published advisory: no floor and no pin below it.
FIXED_IN = {
    "grpcio": ("1.66.2", "CVE-2024-11407"),
    "grpcio-health-checking": ("1.66.2", "CVE-2024-11407, with grpcio"),
    "grpcio-reflection": ("1.66.2", "CVE-2024-11407, with grpcio"),
    "protobuf": ("6.33.5", "CVE-2026-0994"),
    "torch": ("2.10.0", "CVE-2026-24747"),
    "onnx": ("1.21.0", "CVE-2026-27489, CVE-2026-28500, CVE-2026-34445"),
    "scikit-learn": ("1.5.0", "CVE-2024-5206"),
    "transformers": ("5.10.0", "CVE-2026-9856"),
    "cryptography": ("50.0.0", "CVE-2026-69247"),
    "pytest": ("9.0.3", "CVE-2025-71176"),
    "setuptools": ("83.0.0", "CVE-2026-59890"),
    "aiohttp": ("3.13.3", "CVE-2025-69223"),
    # Not requirements of berth's own, so pinned only.
    "urllib3": ("2.7.0", "CVE-2026-44431, CVE-2026-44432"),
    "jinja2": ("3.1.6", "CVE-2025-27516"),
}


def declared() -> list[Requirement]:
    """Every requirement pyproject.toml makes: build, runtime and dev."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [
        Requirement(raw)
        for raw in [
            *project["build-system"]["requires"],
            *project["project"]["dependencies"],
            *project["project"]["optional-dependencies"]["dev"],
        ]
    ]


def pins() -> dict[str, Version]:
    """constraints.txt as name -> pinned version."""
    found: dict[str, Version] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            found[canonicalize_name(name)] = Version(version)
    return found


def floor(name: str) -> Version | None:
    """The lowest version pyproject.toml admits for name, over all the places
    that require it (None where one of them sets no lower bound)."""
    lows = []
    for req in declared():
        if canonicalize_name(req.name) == name:
            bounds = [
                Version(s.version)
                for s in req.specifier
                if s.operator in (">=", ">", "==", "~=")
            ]
            lows.append(max(bounds) if bounds else None)
    assert lows, f"pyproject.toml does not require {name}"
    return None if None in lows else min(v for v in lows if v is not None)


def stub_sources(tmp: Path) -> Iterator[Path]:
    """The generated stubs: the build's, else freshly generated ones."""
    built = sorted((ROOT / "services" / "proto").rglob("*_pb2*.py"))
    if built:
        yield from built
        return
    from services.protogen import generate

    yield from generate(ROOT / "protos", tmp / "services" / "proto")


def generated(tmp: Path, pattern: str) -> Version:
    versions = [
        Version(m.group(1))
        for path in stub_sources(tmp)
        for m in [re.search(pattern, path.read_text(), flags=re.M)]
        if m
    ]
    assert versions, f"no generated stub states {pattern!r}"
    return max(versions)


def test_the_floors_admit_no_runtime_the_stubs_refuse(tmp_path: Path) -> None:
    gencode = generated(tmp_path, r"^# Protobuf Python Version: (\S+)$")
    grpc_generated = generated(tmp_path, r"^GRPC_GENERATED_VERSION = '([^']+)'$")
    protobuf, grpcio = floor("protobuf"), floor("grpcio")
    assert protobuf is not None and protobuf >= gencode, (
        f"protobuf floor {protobuf} is below the stubs' gencode {gencode}"
    )
    assert grpcio is not None and grpcio >= grpc_generated, (
        f"grpcio floor {grpcio} is below GRPC_GENERATED_VERSION {grpc_generated}"
    )


def test_the_pinned_grpcio_tools_generates_what_the_floors_admit() -> None:
    """The stubs a build makes carry the pinned grpcio-tools' version."""
    tools, grpcio = pins()["grpcio-tools"], floor("grpcio")
    assert grpcio is not None and tools <= grpcio, (
        f"grpcio-tools=={tools} generates stubs that refuse grpcio {grpcio}"
    )


@pytest.mark.parametrize("name", sorted(FIXED_IN))
def test_no_floor_or_pin_admits_a_published_advisory(name: str) -> None:
    fixed, advisory = Version(FIXED_IN[name][0]), FIXED_IN[name][1]
    pinned = pins().get(name)
    assert pinned is not None, f"{name} is not pinned in constraints.txt"
    assert pinned >= fixed, f"{name}=={pinned} predates the fix of {advisory}"
    if any(canonicalize_name(r.name) == name for r in declared()):
        low = floor(name)
        assert low is not None and low >= fixed, (
            f"{name} floor {low} admits {advisory} (fixed in {fixed})"
        )


def test_every_requirement_has_a_pin_it_admits() -> None:
    pinned = pins()
    problems = []
    for req in declared():
        name = canonicalize_name(req.name)
        if name not in pinned:
            problems.append(f"{req} has no pin in constraints.txt")
        elif not req.specifier.contains(pinned[name], prereleases=True):
            problems.append(f"{name}=={pinned[name]} does not satisfy {req}")
    assert not problems, "\n".join(problems)


def test_the_constraints_file_pins_exact_public_versions() -> None:
    problems = []
    names = []
    for line in CONSTRAINTS.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([0-9][^\s;+*]*)", line)
        if not match:
            problems.append(f"not an exact pin: {line!r}")
            continue
        name = match.group(1)
        names.append(name)
        if name != canonicalize_name(name):
            problems.append(f"{name}: write it {canonicalize_name(name)}")
        if CUDA_ONLY.match(name):
            problems.append(f"{name}: a CUDA-only wheel (CI has no GPU)")
    if names != sorted(set(names)):
        problems.append("pins are not sorted, or one is repeated")
    torch_cpu = re.search(r"^TORCH_CPU \?= torch==(\S+)$", make(), flags=re.M)
    assert torch_cpu, "the Makefile sets no TORCH_CPU"
    if Version(torch_cpu.group(1)) != pins()["torch"]:
        problems.append(f"the Makefile's TORCH_CPU is not torch=={pins()['torch']}")
    assert not problems, "\n".join(problems)


def make() -> str:
    return (ROOT / "Makefile").read_text()


def installs(text: str) -> Iterator[str]:
    """Each pip install (or pip wheel: a build) command of a Makefile or
    Dockerfile (continued lines joined, then split at ; and &&)."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    for command in re.split(r"\n|;|&&", joined):
        if "pip install" in command or "pip wheel" in command:
            yield " ".join(command.split())


# Every Dockerfile: at the root and under deploy/ (tests/test_deploy.py
# lints the same ones).
DOCKERFILES = sorted(
    str(p.relative_to(ROOT))
    for p in [*ROOT.glob("Dockerfile*"), *(ROOT / "deploy").rglob("Dockerfile*")]
)


@pytest.mark.parametrize("name", ["Makefile", *DOCKERFILES])
def test_every_install_goes_through_the_constraints(name: str) -> None:
    text = (ROOT / name).read_text()
    pinned = text.replace("$(PINNED)", "-c constraints.txt --build-constraint")
    problems = []
    for command in installs(pinned):
        if "CONSTRAINTS_VENV" in command:
            continue  # `make constraints`: the newest pip, to re-resolve
        if "-c constraints.txt" not in command:
            problems.append(f"unconstrained: {command}")
        if re.search(r" (-e )?'?\.(\[dev\])?'?( |$)", command) and (
            "--build-constraint" not in command
        ):
            problems.append(f"berth built without --build-constraint: {command}")
    assert not problems, "\n".join(problems)


def closure() -> dict[str, str]:
    """name -> installed version of berth (with its dev extra) and of
    everything it requires, transitively, as installed here."""
    found: dict[str, str] = {}
    todo = [("berth", frozenset({"dev"}))]
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in done:
            continue
        done.add((name, extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found[name] = dist.version
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is None or any(
                req.marker.evaluate({"extra": e}) for e in extras | {""}
            ):
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return found


def test_the_environment_is_the_pinned_one() -> None:
    """What `make venv` installed is what constraints.txt says (torch by its
    public version: the CPU build is 2.13.0+cpu)."""
    try:
        metadata.distribution("berth")
    except metadata.PackageNotFoundError:
        pytest.skip("berth is not installed here (`make venv` installs it)")
    pinned = pins()
    stale = [
        f"{name} {version} installed, constraints.txt pins {pinned[name]}"
        for name, version in sorted(closure().items())
        if name in pinned and Version(Version(version).public) != pinned[name]
    ]
    assert not stale, "\n".join(stale) + "\nreinstall: make venv"
