"""The docs agree with the code: docs/configuration.md lists exactly the flags
each parser defines and the BERTH_* variables the source reads, and every
relative link in README.md and docs/*.md leads to a file (and heading) that
exists."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock
from urllib.parse import unquote

import pytest

import services.config
import services.idle
from services.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = ROOT / "docs" / "configuration.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# What a flag's line says when the flag reads no BERTH_* variable.
NO_VARIABLE = "No `BERTH_` variable"
VARIABLES = "BERTH_* environment variables"  # that section's title
# Names in the source that stand for others (services/config.py's docstring).
PLACEHOLDERS = {"BERTH_NAME"}
SOURCES = ("gateway", "batcher", "engine", "services")

# command -> (--flag -> dest, the dests whose flags read a BERTH_* variable)
Parsers = dict[str, tuple[dict[str, str], set[str]]]


@contextmanager
def _variables_read() -> Iterator[set[tuple[int, str]]]:
    """(id of the parser, flag dest) for each flag made by services.config's
    add_flag, which reads the flag's BERTH_* variable through env()."""
    read: set[tuple[int, str]] = set()
    real = services.config.env

    def env(name: str, default: object) -> object:
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None  # add_flag
        if caller is not None:
            read.add((id(caller.f_locals.get("parser")), name))
        return real(name, default)

    with mock.patch.object(services.config, "env", env):
        yield read


def collect() -> dict[str, dict[str, list[str] | dict[str, str]]]:
    """Each documented command's flags (``--name`` -> dest) and the dests of
    those that read a BERTH_* variable."""
    with _variables_read() as read:
        (commands,) = [
            a
            for a in build_parser()._actions
            if isinstance(a, argparse._SubParsersAction)
        ]
        found = {f"berth {name}": sub for name, sub in commands.choices.items()}
        for module in ("gateway", "batcher", "engine"):
            main = importlib.import_module(f"{module}.__main__")
            found[f"python -m {module}"] = main.build_parser()
        found["python -m services.idle"] = services.idle.build_parser()
    return {
        title: {
            "flags": flags(parser),
            "reads": sorted(name for at, name in read if at == id(parser)),
        }
        for title, parser in found.items()
    }


@pytest.fixture(scope="module")
def parsers() -> Parsers:
    """:func:`collect`, in a process of its own: the gateway's KServe stubs
    and tritonclient's (the KServe tests load it) declare the same protobuf
    package, and one process cannot hold both."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.test_docs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    return {
        title: (dict(data["flags"]), set(data["reads"]))
        for title, data in found.items()
    }


def sections(text: str) -> dict[str, str]:
    """A page's level-2 sections by title, backticks dropped."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {
        parts[i].replace("`", "").strip(): parts[i + 1] for i in range(1, len(parts), 2)
    }


def rows(section: str) -> dict[str, str]:
    """A section's table rows by the name in their first cell (in backticks)."""
    return dict(re.findall(r"^\| `([^`]+)` \|(.*)$", section, flags=re.M))


def flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each of a parser's flags (its first --name) and its dest."""
    return {
        a.option_strings[0]: a.dest
        for a in parser._actions
        if a.option_strings
        and a.option_strings[0].startswith("--")
        and not isinstance(a, argparse._HelpAction)
    }


def test_each_command_documents_exactly_its_flags(parsers: Parsers) -> None:
    documented = sections(CONFIGURATION.read_text())
    problems = [
        f"section '{title}' documents no command"
        for title in documented
        if title.startswith(("berth ", "python -m ")) and title not in parsers
    ]
    for title, (code, reads_variable) in parsers.items():
        if title not in documented:
            problems.append(f"{title}: no section '## `{title}`'")
            continue
        lines = rows(documented[title])
        missing, stale = code.keys() - lines.keys(), lines.keys() - code.keys()
        problems += [f"{title}: {f} has no line" for f in sorted(missing)]
        problems += [f"{title}: {f} is no flag" for f in sorted(stale)]
        for flag in sorted(code.keys() & lines.keys()):
            if (NO_VARIABLE in lines[flag]) == (code[flag] in reads_variable):
                problems.append(f"{title}: {flag}: '{NO_VARIABLE}' is wrong")
    assert not problems, "\n".join(problems)


def test_the_variables_table_lists_exactly_what_the_source_reads(
    parsers: Parsers,
) -> None:
    files = [
        path
        for folder in SOURCES
        for pattern in ("*.py", "*.pyx")
        for path in (ROOT / folder).rglob(pattern)
        if "proto" not in path.relative_to(ROOT).parts  # generated stubs
    ]
    source = "\n".join(path.read_text() for path in files)
    named = set(re.findall(r"BERTH_[A-Z0-9_]+", source))
    # services.config.env("NAME", default) reads BERTH_NAME.
    named |= {f"BERTH_{n.upper()}" for n in re.findall(r'\benv\(\s*"(\w+)"', source)}
    named = {n for n in named if not n.endswith("_")} - PLACEHOLDERS
    of_flags = {
        f"BERTH_{dest.upper()}" for _, read in parsers.values() for dest in read
    }
    text = CONFIGURATION.read_text()
    table, expected = set(rows(sections(text)[VARIABLES])), named - of_flags
    assert table == expected, (
        f"missing: {sorted(expected - table)}; read by no code: "
        f"{sorted(table - expected)}"
    )
    stale = set(re.findall(r"BERTH_[A-Z0-9_]*[A-Z0-9]", text)) - named - of_flags
    assert not stale, f"configuration.md names what no code reads: {sorted(stale)}"


def _without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def anchors(text: str) -> set[str]:
    """The heading anchors of a page, by GitHub's rules: lower case, anything
    but word characters, hyphens and spaces dropped, spaces to hyphens, and
    -1, -2... for repeats."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for title in re.findall(r"^#{1,6} +(.+?)\s*$", _without_fences(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        repeats = seen.get(slug, 0)
        seen[slug] = repeats + 1
        found.add(f"{slug}-{repeats}" if repeats else slug)
    return found


def links(text: str) -> list[str]:
    """Link targets outside code: inline [text](target) and [name]: target."""
    text = re.sub(r"`[^`\n]*`", "", _without_fences(text))
    inline = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    return inline + re.findall(r"^\s*\[[^\]]+\]:\s*<?([^\s>]+)", text, flags=re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page.read_text()):
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target):  # http:, mailto:...
            continue
        path, _, anchor = unquote(target).partition("#")
        found = (page.parent / path).resolve() if path else page
        if not found.is_relative_to(ROOT) or not found.exists():
            broken.append(f"{target}: no such file in the repository")
        elif (
            anchor
            and found.suffix == ".md"
            and anchor not in anchors(found.read_text())
        ):
            broken.append(f"{target}: {found.name} has no heading #{anchor}")
    assert not broken, "\n".join(broken)


if __name__ == "__main__":
    print(json.dumps(collect()))
