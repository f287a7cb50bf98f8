"""Model repository loading: every field of berth.json is checked, and a bad
one is refused with the file, the field and what it must be."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.default_models import minilm_checkpoint
from services.repository import RepositoryError, load_repository


def write_entry(root: Path, **fields: Any) -> Path:
    checkpoint = str(minilm_checkpoint())
    data = {"name": "m", "task": "embed", "checkpoint": checkpoint, **fields}
    (root / "m").mkdir(parents=True)
    config = root / "m" / "berth.json"
    config.write_text(json.dumps(data))
    return config


def test_a_good_entry_loads(tmp_path: Path) -> None:
    write_entry(tmp_path, normalize=False, buckets=[16, 8], max_tokens=32)
    entry = load_repository(tmp_path)["m"]
    assert entry.normalize is False
    assert entry.buckets == [8, 16, 32] and entry.max_tokens == 32


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("normalize", "false"),  # a string: it would read as True
        ("normalize", 0),
        ("buckets", 32),
        ("buckets", ["32", "64"]),
        ("buckets", [0, 32]),
        ("buckets", [-16]),
        ("buckets", [16.5]),
        ("max_tokens", "512"),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("name", ""),
        ("name", 7),
        ("checkpoint", None),
        ("head", 3),
        ("backend", ["torch"]),
    ],
)
def test_a_bad_field_is_refused_by_name(
    tmp_path: Path, field: str, value: object
) -> None:
    config = write_entry(tmp_path, **{field: value})
    with pytest.raises(RepositoryError) as info:
        load_repository(tmp_path)
    message = str(info.value)
    assert str(config) in message and field in message, message
