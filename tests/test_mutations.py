"""`make mutations` stays runnable as the code moves: each deliberate break
in tests/mutations.toml still finds the text it replaces exactly once, and
each test it names still exists. (Whether the tests catch the breaks is what
`make mutations` itself runs: minutes per break.)"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import mutations  # noqa: E402

MUTATIONS = mutations.load(ROOT / "tests" / "mutations.toml")


def defined_tests(path: Path) -> set[str]:
    """Names of the test functions a test file defines at its top level."""
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_break_still_applies_to_the_code(mutation: mutations.Mutation) -> None:
    text = (ROOT / mutation.file).read_text()
    for old, _ in mutation.edits:
        assert text.count(old) == 1, (
            f"{mutation.file}: the text to replace is found {text.count(old)} "
            f"times, not once: {old!r}"
        )
    for test in mutation.tests:
        file, _, name = test.partition("::")
        assert (ROOT / file).is_file(), test
        if name:
            assert name.split("[")[0] in defined_tests(ROOT / file), test
