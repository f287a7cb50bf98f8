"""Logging set-up shared by every berth process."""

from __future__ import annotations

import logging
import os

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


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
    return logging.getLogger(f"berth.{service}")
