"""The mutation check: break one behaviour at a time, run the tests that
must catch it, and count how many breaks they catch.

    python scripts/mutations.py                 # every break in tests/mutations.toml
    python scripts/mutations.py -k hedge -k cache   # the breaks whose name matches

Each break is applied to a copy of the working tree (tracked and untracked
files, plus the generated protobuf stubs and the built Cython core), so the
checkout is never touched. The copy's tests run with the copy first on
``PYTHONPATH``; the services they start run from the copy too. Before any
break, the paired tests run once on the unbroken copy: a test that fails
there cannot say anything about a break.

A break is *caught* when its tests fail (pytest exits 1), *missed* when
they pass; anything else (a test collected nowhere, a timeout, a crash) is an
error. The exit status is 0 only when every break tried was caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTATIONS = ROOT / "tests" / "mutations.toml"
# Built, not tracked: the copy needs them to import and to run the services.
GENERATED = ["services/proto", "batcher/_core_c*.so"]


@dataclass
class Mutation:
    """One deliberate break and the tests that must catch it."""

    name: str
    file: str
    edits: list[tuple[str, str]]  # (exact text, replacement), each found once
    tests: list[str]
    build: str = ""  # "cython": rebuild the core after the edit
    why: str = ""


def load(path: Path) -> list[Mutation]:
    data = tomllib.loads(path.read_text())
    found = []
    for item in data["mutation"]:
        edits = [(e[0], e[1]) for e in item["edits"]]
        found.append(
            Mutation(
                name=item["name"],
                file=item["file"],
                edits=edits,
                tests=list(item["tests"]),
                build=item.get("build", ""),
                why=item.get("why", ""),
            )
        )
    return found


def copy_tree(dest: Path) -> None:
    """The working tree as it is (edits included), without ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        source = ROOT / raw.decode()
        if source.is_file():
            target = dest / raw.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    for pattern in GENERATED:
        for source in ROOT.glob(pattern):
            target = dest / source.relative_to(ROOT)
            if source.is_dir():
                shutil.copytree(source, target, dirs_exist_ok=True)
            else:
                shutil.copy2(source, target)


def apply(mutation: Mutation, tree: Path) -> None:
    path = tree / mutation.file
    text = path.read_text()
    for old, new in mutation.edits:
        count = text.count(old)
        if count != 1:
            raise SystemExit(
                f"mutation {mutation.name!r}: {mutation.file} holds its text "
                f"{count} times, not once; update tests/mutations.toml:\n{old}"
            )
        text = text.replace(old, new)
    path.write_text(text)
    if mutation.build == "cython":
        subprocess.run(
            [str(Path(sys.executable).parent / "cythonize"), "-i", "-q", mutation.file],
            cwd=tree,
            check=True,
            capture_output=True,
        )


def pytest(tree: Path, tests: list[str], timeout_s: float) -> tuple[int, float, str]:
    """pytest's exit status on these tests in the tree (124: timed out), the
    seconds it took, and the first test that failed."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE"]
    command += ["-p", "no:cacheprovider"]
    start = time.monotonic()
    try:
        done = subprocess.run(
            [*command, *tests],
            cwd=tree,
            env=env,
            timeout=timeout_s,
            capture_output=True,
            text=True,
        )
    except subprocess.TimeoutExpired:
        return 124, time.monotonic() - start, ""
    if done.returncode not in (0, 1):
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
    failed = [
        line.split()[1]
        for line in done.stdout.splitlines()
        if line.startswith(("FAILED ", "ERROR "))
    ]
    return done.returncode, time.monotonic() - start, failed[0] if failed else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", action="append", default=[], help="name contains")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the unbroken run"
    )
    args = parser.parse_args()
    chosen = [
        m for m in load(MUTATIONS) if not args.k or any(k in m.name for k in args.k)
    ]
    if not chosen:
        raise SystemExit("no mutation matches")
    if not args.no_baseline:
        tests = list(dict.fromkeys(t for m in chosen for t in m.tests))
        print(f"unbroken: {len(tests)} test selections ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="berth-mutation-") as tmp:
            copy_tree(Path(tmp))
            code, took, _ = pytest(Path(tmp), tests, args.timeout_s * 2)
        if code != 0:
            print(f"the unbroken tree fails its tests (exit {code}): fix that first")
            return 2
        print(f"unbroken: passed in {took:.0f} s", flush=True)
    rows = []
    for mutation in chosen:
        with tempfile.TemporaryDirectory(prefix="berth-mutation-") as tmp:
            tree = Path(tmp)
            copy_tree(tree)
            apply(mutation, tree)
            code, took, failed = pytest(tree, mutation.tests, args.timeout_s)
        result = {0: "MISSED", 1: "caught"}.get(code, f"error ({code})")
        rows.append((mutation.name, result, took, failed))
        print(f"{mutation.name:<44} {result:<12} {took:6.0f} s  {failed}", flush=True)
    caught = sum(row[1] == "caught" for row in rows)
    print()
    print("| break | result | first test to fail | seconds |")
    print("| --- | --- | --- | --- |")
    for name, result, took, failed in rows:
        print(f"| {name} | {result} | `{failed}` | {took:.0f} |")
    print(f"\nscore: {caught} / {len(rows)} caught")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
