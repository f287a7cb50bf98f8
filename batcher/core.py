"""Selects the batcher core: the Cython extension, else the pure-Python twin.

Set ``BERTH_PURE_PYTHON=1`` to force the twin. ``IMPLEMENTATION`` says which
one was loaded ("cython" or "python").
"""

from __future__ import annotations

import logging
import os

from batcher._core_py import (
    REASON_CANCELLED,
    REASON_EXPIRED,
    Batch,
    QueueFull,
)

log = logging.getLogger("berth.batcher")

IMPLEMENTATION: str
if os.environ.get("BERTH_PURE_PYTHON") == "1":
    from batcher._core_py import BucketCore

    IMPLEMENTATION = "python"
else:
    try:
        from batcher._core_c import BucketCore  # type: ignore[assignment]

        IMPLEMENTATION = "cython"
    except ImportError as exc:
        from batcher._core_py import BucketCore

        IMPLEMENTATION = "python"
        log.warning("batcher core: Cython extension not built (%s); using Python", exc)

__all__ = [
    "IMPLEMENTATION",
    "REASON_CANCELLED",
    "REASON_EXPIRED",
    "Batch",
    "BucketCore",
    "QueueFull",
]
