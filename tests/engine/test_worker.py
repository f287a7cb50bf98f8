"""``python -m engine``, the worker process: what its flags accept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_an_unknown_model_in_models_is_named(repository: Path) -> None:
    """--models naming a model the repository lacks stops the worker with
    the name, the flag and what the repository has (not a bare KeyError)."""
    done = subprocess.run(
        [sys.executable, "-m", "engine", "--models", "minilm,nope", "--port", "0",
         "--metrics-port", "0", "--model-repository", str(repository)],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "--models" in last and "'nope'" in last and "intent" in last, last
