"""The engine's settings: every ``BERTH_*`` variable an engine reads, at once.

``python -m engine`` reads them at start-up (:func:`load`), refuses a bad
value naming the variable, and logs what it runs with; the code asks
:func:`current`. Each is an operator's escape hatch for correctness or
compatibility, not a speed experiment: where berth has two ways and one is
faster on a shape, it times both at start-up and keeps the faster
(docs/performance.md says which, and by how much).

- ``BERTH_CUDA_DTYPE`` (float16): GPU weights, float16 or bfloat16 (for a
  model whose activations overflow fp16);
- ``BERTH_CUDA_INPUT`` (zero-copy): graphs read and write mapped pinned
  memory; ``staging`` copies around each replay instead;
- ``BERTH_EXACT_GELU`` (0): 1 computes erf GELU after the product instead
  of the tanh form in its epilogue;
- ``BERTH_PDL`` (1): 0 launches every kernel the classic way, never
  dependent on its predecessor;
- ``BERTH_ATTENTION`` (auto: the faster per shape): always flash, triton
  or sdpa;
- ``BERTH_CUBLASLT`` (1): 0 runs every product through torch, none as
  berth's own cuBLASLt calls;
- ``BERTH_TORCH_THREADS`` (0: the CPUs this process may run on): torch's
  CPU threads;
- ``BERTH_CACHE_DIR`` (~/.cache/berth): exported ONNX models and TensorRT
  engines.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("float16", "bfloat16")
INPUT_MODES = ("zero-copy", "staging")
ATTENTION = ("auto", "flash", "triton", "sdpa")


class SettingsError(ValueError):
    """A ``BERTH_*`` variable holds a value the engine cannot take."""


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "berth"


@dataclass(frozen=True)
class EngineSettings:
    """What an engine runs with, beside its flags (the module docstring)."""

    cuda_dtype: str = "float16"
    cuda_input: str = "zero-copy"
    exact_gelu: bool = False
    pdl: bool = True
    attention: str = "auto"
    cublaslt: bool = True
    torch_threads: int = 0
    cache_dir: Path = field(default_factory=_default_cache_dir)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> EngineSettings:
        """The settings ``environ`` gives; an unset or empty variable keeps
        its default."""
        values: dict[str, object] = {}
        for item in dataclasses.fields(cls):
            name = f"BERTH_{item.name.upper()}"
            raw = environ.get(name, "").strip()
            if raw:
                values[item.name] = _parse(name, raw, getattr(cls(), item.name))
        settings = cls(**values)  # type: ignore[arg-type]
        settings.check()
        return settings

    def check(self) -> None:
        """Refuses a value outside its choices, naming the variable."""
        for name, value, allowed in (
            ("BERTH_CUDA_DTYPE", self.cuda_dtype, DTYPES),
            ("BERTH_CUDA_INPUT", self.cuda_input, INPUT_MODES),
            ("BERTH_ATTENTION", self.attention, ATTENTION),
        ):
            if value not in allowed:
                raise SettingsError(
                    f"{name}={value!r}: use one of {', '.join(allowed)}"
                )
        if self.torch_threads < 0:
            raise SettingsError(
                f"BERTH_TORCH_THREADS={self.torch_threads}: use 0 (every CPU "
                "this process may run on) or a positive count"
            )

    def describe(self) -> str:
        """One line for the start-up log: the settings that differ from the
        defaults, or that there are none."""
        changed = [
            f"BERTH_{item.name.upper()}={getattr(self, item.name)}"
            for item in dataclasses.fields(self)
            if getattr(self, item.name) != getattr(EngineSettings(), item.name)
        ]
        return ", ".join(changed) if changed else "the defaults"


def _parse(name: str, raw: str, default: object) -> object:
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{name}={raw!r}: use 1 or 0")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise SettingsError(f"{name}={raw!r}: use a whole number") from None
    if isinstance(default, Path):
        return Path(raw).expanduser()
    return raw


_current: EngineSettings | None = None


def load(environ: Mapping[str, str] = os.environ) -> EngineSettings:
    """Read the settings from the environment, once, for this process."""
    global _current
    _current = EngineSettings.from_environ(environ)
    return _current


def current() -> EngineSettings:
    """This process's settings (read from the environment on first use)."""
    return _current if _current is not None else load()


def use(settings: EngineSettings) -> None:
    """Run with ``settings`` from now on (benchmarks and tests)."""
    global _current
    settings.check()
    _current = settings
