"""Logging set-up shared by every berth process."""

from __future__ import annotations

import logging
import os

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Libraries that log each step at INFO: torch.onnx's exporter (through
# onnx_ir / onnxscript) writes a line per deduplicated initializer, ~60 for a
# 2-layer model and hundreds for the default ones, on every first export.
# They log at WARNING and above unless BERTH_LOG_LEVEL is DEBUG.
CHATTY = ("onnx_ir", "onnxscript", "torch.onnx")


def setup_logging(service: str) -> logging.Logger:
    """Log lines that name the service; level from BERTH_LOG_LEVEL."""
    raw = os.environ.get("BERTH_LOG_LEVEL", "")
    level = raw.strip().upper() or "INFO"  # empty: unset
    if level == "WARN":
        level = "WARNING"
    if level not in LEVELS:
        choices = ", ".join(LEVELS)
        raise ValueError(f"BERTH_LOG_LEVEL={raw!r} is not a log level: use {choices}")
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {service:<8} %(levelname)-5s %(name)s: %(message)s",
    )
    if level != "DEBUG":
        floor = max(logging.WARNING, logging.getLevelName(level))
        for name in CHATTY:
            logging.getLogger(name).setLevel(floor)
    return logging.getLogger(f"berth.{service}")
