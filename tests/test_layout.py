"""The layout keeps the design's boundaries: each process imports only what
it may, and no module or function grows past what one sitting can read.

Imports are read from the source (every ``import`` and ``from … import``,
inside functions too), so a lazy import cannot slip past.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "batcher", "engine", "services")
# Per package: the imports it must not make (a module name or a prefix).
FORBIDDEN = {
    "engine": ("gateway", "batcher"),
    "batcher": ("gateway", "engine"),
    "gateway": ("engine",),
    # The runtime plumbing stands under every process and under the CLI.
    "services": ("gateway", "batcher", "engine", "services.cli"),
}
MAX_MODULE_LINES = 520
MAX_FUNCTION_LINES = 85
# The Python client, a distribution of its own (clients/python): it may
# import the standard library, grpc, protobuf and itself, nothing else.
CLIENT = ROOT / "clients" / "python"
CLIENT_IMPORTS = ("berth_client", "grpc", "google.protobuf")


def sources() -> Iterator[Path]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "proto" not in path.relative_to(ROOT).parts:
                yield path


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module
            for alias in node.names:  # `from engine import quant`
                yield node.lineno, f"{node.module}.{alias.name}"


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_imports_follow_the_process_boundaries() -> None:
    crossing = []
    for path in sources():
        rel = path.relative_to(ROOT)
        package = rel.parts[0]
        if package == "services" and rel.parts[1] == "cli":
            continue  # the berth command starts and builds everything
        for line, module in imports(path):
            for banned in FORBIDDEN[package]:
                if within(module, banned):
                    crossing.append(f"{rel}:{line} imports {module}")
    assert not crossing, "\n".join(crossing)


def test_the_gateway_uses_the_batcher_only_through_its_public_api() -> None:
    """gateway/ may import the package ``batcher`` (what batcher/__init__.py
    exports), never a module inside it."""
    import batcher

    reaching = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        for line, module in imports(path):
            if module.startswith("batcher."):
                name = module.removeprefix("batcher.")
                if name not in getattr(batcher, "__all__", ()):
                    reaching.append(f"{path.relative_to(ROOT)}:{line} {module}")
    assert not reaching, "\n".join(reaching)


def client_sources() -> list[Path]:
    """The client's hand-written modules (not its generated stubs)."""
    return [
        path
        for path in sorted(CLIENT.rglob("*.py"))
        if not {"_proto", "build"} & set(path.relative_to(CLIENT).parts)
    ]


def test_the_client_imports_only_grpc_and_protobuf() -> None:
    stdlib = sys.stdlib_module_names
    foreign = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in client_sources()
        if path.is_relative_to(CLIENT / "berth_client")  # not its build script
        for line, module in imports(path)
        if module.partition(".")[0] not in stdlib
        and not any(within(module, allowed) for allowed in CLIENT_IMPORTS)
    ]
    assert client_sources(), "no client sources found"
    assert not foreign, "\n".join(foreign)


def readable() -> list[Path]:
    """Every hand-written module: the packages, the client, the benchmarks,
    the scripts."""
    more = [*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]
    return [*sources(), *client_sources(), *sorted(more)]


@pytest.mark.parametrize("path", readable(), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_and_functions_stay_readable(path: Path) -> None:
    text = path.read_text()
    lines = text.count("\n")
    assert lines <= MAX_MODULE_LINES, f"{lines} lines: split it by concern"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
