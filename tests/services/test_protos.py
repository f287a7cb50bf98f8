"""Generated stubs must match protos/: a stale build fails here."""

from __future__ import annotations

from pathlib import Path

from services.protogen import generate
from tests.stack import ROOT


def test_installed_stubs_are_fresh(tmp_path: Path) -> None:
    installed = ROOT / "services" / "proto"
    fresh_root = tmp_path / "services" / "proto"
    fresh = generate(ROOT / "protos", fresh_root)
    assert fresh, "protos/ produced no stubs"
    for path in fresh:
        relative = path.relative_to(fresh_root)
        current = installed / relative
        assert current.exists(), f"{relative} is missing: reinstall (make venv)"
        assert current.read_bytes() == path.read_bytes(), (
            f"services/proto/{relative} is stale against protos/: "
            "rebuild with `pip install -e .` (or `make venv`)"
        )


def test_every_proto_has_stubs() -> None:
    for proto in (ROOT / "protos").rglob("*.proto"):
        stem = proto.relative_to(ROOT / "protos").with_suffix("")
        generated = ROOT / "services" / "proto" / f"{stem}_pb2.py"
        assert generated.exists(), f"no stub for {proto}"
