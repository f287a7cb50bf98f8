"""Fixtures that run each batcher core test against both implementations."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

from batcher import _core_py


def cython_core() -> ModuleType:
    """The compiled core; fails loudly when missing unless explicitly allowed."""
    try:
        return importlib.import_module("batcher._core_c")
    except ImportError as exc:
        if os.environ.get("BERTH_ALLOW_NO_CYTHON") == "1":
            pytest.skip(f"Cython core not built ({exc}); BERTH_ALLOW_NO_CYTHON=1")
        pytest.fail(
            f"Cython core batcher._core_c is not built ({exc}). Build it with "
            "`cythonize -i batcher/_core_c.pyx` (or `pip install -e .`), or set "
            "BERTH_ALLOW_NO_CYTHON=1 to skip the Cython tests.",
            pytrace=False,
        )


@pytest.fixture(params=["python", "cython"])
def core_mod(request: pytest.FixtureRequest) -> ModuleType:
    """The module providing ``BucketCore``: the twin or the Cython core."""
    return _core_py if request.param == "python" else cython_core()


@pytest.fixture(scope="session")
def core_c() -> ModuleType:
    """The compiled core alone (the property test compares it with the twin)."""
    return cython_core()
