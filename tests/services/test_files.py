"""Files written whole or not at all, and checked before reuse
(services/files.py), and the ONNX export cache that relies on them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from services import files
from services.repository import ModelEntry


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(
    tmp_path: Path,
) -> None:
    path = tmp_path / "model.plan"
    files.write_bytes(path, b"old")

    def fails(tmp: Path) -> None:
        tmp.write_bytes(b"half of it")
        raise RuntimeError("the build failed")

    with pytest.raises(RuntimeError, match="the build failed"):
        files.atomic_write(path, fails)
    assert [p.name for p in tmp_path.iterdir()] == ["model.plan"]
    assert path.read_bytes() == b"old"


def test_a_sealed_file_is_verified_until_its_bytes_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, data = tmp_path / "x.onnx", tmp_path / "x.onnx.data"
    assert not files.verified(path, "export")  # missing: no warning
    files.write_bytes(data, b"weights")
    files.write_bytes(path, b"graph")
    assert not files.verified(path, "export")  # no checksum yet
    files.seal(path, [data])
    assert files.verified(path, "export")
    data.write_bytes(b"weightz")
    with caplog.at_level(logging.WARNING, "berth.files"):
        assert not files.verified(path, "export")
    assert "does not match its checksum (x.onnx.data)" in caplog.text


def test_a_corrupted_onnx_export_is_exported_again(
    tiny: ModelEntry, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("onnx")
    from engine.build.onnx_export import export_entry

    path = export_entry(tiny, tmp_path)
    good = path.read_bytes()
    mtime = path.stat().st_mtime_ns
    assert export_entry(tiny, tmp_path) == path  # reused as it is
    assert path.stat().st_mtime_ns == mtime
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0xFF  # same size, one byte off
    path.write_bytes(bytes(damaged))
    with caplog.at_level(logging.WARNING, "berth.files"):
        assert export_entry(tiny, tmp_path) == path
    assert path.read_bytes() != bytes(damaged)
    assert "does not match its checksum" in caplog.text
    assert files.verified(path, "ONNX export")
    leftovers = [p.name for p in path.parent.iterdir() if p.name.startswith(".")]
    assert all(name.endswith(".lock") for name in leftovers), leftovers
