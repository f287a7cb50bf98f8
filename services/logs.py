"""Logging set-up shared by every berth process."""

from __future__ import annotations

import logging
import os


def setup_logging(service: str) -> logging.Logger:
    """Log lines that name the service; level from BERTH_LOG_LEVEL."""
    level = os.environ.get("BERTH_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {service:<8} %(levelname)-5s %(name)s: %(message)s",
    )
    return logging.getLogger(f"berth.{service}")
