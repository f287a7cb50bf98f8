"""The engine's settings: read once from BERTH_* variables, checked, logged."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine import settings as engine_settings
from engine.settings import EngineSettings, SettingsError

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def test_unset_and_empty_variables_keep_the_defaults() -> None:
    assert EngineSettings.from_environ({}) == EngineSettings()
    assert EngineSettings.from_environ({"BERTH_PDL": " "}) == EngineSettings()
    assert EngineSettings().describe() == "the defaults"


def test_each_variable_sets_its_field() -> None:
    read = EngineSettings.from_environ(
        {
            "BERTH_CUDA_DTYPE": "bfloat16",
            "BERTH_CUDA_INPUT": "staging",
            "BERTH_EXACT_GELU": "1",
            "BERTH_PDL": "0",
            "BERTH_ATTENTION": "sdpa",
            "BERTH_CUBLASLT": "false",
            "BERTH_TORCH_THREADS": "3",
            "BERTH_CACHE_DIR": "/tmp/berth-cache",
        }
    )
    assert read == EngineSettings(
        cuda_dtype="bfloat16",
        cuda_input="staging",
        exact_gelu=True,
        pdl=False,
        attention="sdpa",
        cublaslt=False,
        torch_threads=3,
        cache_dir=Path("/tmp/berth-cache"),
    )
    assert "BERTH_PDL=False" in read.describe()
    assert "BERTH_CUDA_DTYPE=bfloat16" in read.describe()


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("BERTH_CUDA_DTYPE", "float32", "use one of float16, bfloat16"),
        ("BERTH_CUDA_INPUT", "mapped", "use one of zero-copy, staging"),
        ("BERTH_ATTENTION", "xformers", "use one of auto, flash, triton, sdpa"),
        ("BERTH_PDL", "maybe", "use 1 or 0"),
        ("BERTH_TORCH_THREADS", "many", "use a whole number"),
        ("BERTH_TORCH_THREADS", "-2", "use 0"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(
    variable: str, value: str, says: str
) -> None:
    with pytest.raises(SettingsError) as info:
        EngineSettings.from_environ({variable: value})
    assert str(info.value).startswith(f"{variable}=")
    assert says in str(info.value)


def test_the_engine_process_refuses_a_bad_setting_before_it_starts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "engine", "--port", "0", "--metrics-port", "0"],
        env={"BERTH_ATTENTION": "xformers", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ENGINE.parent,
    )
    assert done.returncode == 1, done.stderr
    assert "python -m engine: BERTH_ATTENTION='xformers'" in done.stderr


def test_use_replaces_the_process_settings() -> None:
    before = engine_settings.current()
    try:
        engine_settings.use(EngineSettings(attention="triton"))
        assert engine_settings.current().attention == "triton"
        with pytest.raises(SettingsError):
            engine_settings.use(EngineSettings(attention="nope"))
    finally:
        engine_settings.use(before)


def test_no_engine_module_reads_the_environment_for_a_setting() -> None:
    """Every BERTH_* an engine module names is one engine/settings.py reads
    (or a variable of the shared plumbing): no switch read deep in the code."""
    fields = {f"BERTH_{name.upper()}" for name in EngineSettings.__dataclass_fields__}
    for path in ENGINE.rglob("*.py"):
        if path.name == "settings.py":
            continue
        text = path.read_text()
        assert not re.search(r"environ(\.get\(|\[)\s*[\"']BERTH_", text), path
        assert "from services.config import env" not in text, path
        for word in text.replace("`", " ").split():
            name = word.strip(".,;:()=\"'")
            if name.startswith("BERTH_") and name[6:].isupper():
                assert name.split("=")[0] in fields, f"{path}: {name}"
