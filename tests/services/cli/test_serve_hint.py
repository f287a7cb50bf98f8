"""`berth serve`'s first line suggests a call to a model it serves."""

from __future__ import annotations

from pathlib import Path

from services.cli.client import DEFAULT_ADDRESS
from services.cli.serve import try_hint


def test_the_hint_names_a_served_model_and_the_address(
    repository: Path, tmp_path: Path
) -> None:
    # The default repository: an embedding model is preferred to a classifier.
    assert try_hint(repository, DEFAULT_ADDRESS) == (
        " (try: berth embed --model minilm 'hello world')"
    )
    assert try_hint(repository, "127.0.0.1:6000") == (
        " (try: berth embed --model minilm --address 127.0.0.1:6000 'hello world')"
    )
    assert try_hint(tmp_path, DEFAULT_ADDRESS) == ""  # nothing to suggest
