"""Logging set-up shared by every berth process."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from opentelemetry import trace

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
        format=(
            f"%(asctime)s {service:<8} %(levelname)-5s %(name)s: %(message)s%(trace)s"
        ),
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(with_trace_id)
    if level != "DEBUG":
        floor = max(logging.WARNING, logging.getLevelName(level))
        for name in CHATTY:
            logging.getLogger(name).setLevel(floor)
    return logging.getLogger(f"berth.{service}")


def with_trace_id(record: logging.LogRecord) -> bool:
    """A logging filter: ``record.trace`` is " trace=<trace id>" when the
    line is logged under a span (a request's, or its caller's context), so
    a log line leads to its trace in Jaeger; "" otherwise."""
    context = trace.get_current_span().get_span_context()
    record.trace = f" trace={context.trace_id:032x}" if context.is_valid else ""
    return True


class Throttled:
    """One log line per ``period_s`` for an event a caller can repeat at will
    (a request that cannot be parsed): the first at once, later ones counted
    and reported with the next line that is let through, so a flood of them
    cannot fill the log."""

    def __init__(
        self,
        log: logging.Logger,
        period_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.period_s = period_s
        self._clock = clock
        self._next = 0.0
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        now = self._clock()
        if now < self._next:
            self._suppressed += 1
            return
        if self._suppressed:
            message += " (and %d more like it in the last %.0f s, not logged)"
            args = (*args, self._suppressed, self.period_s)
        self._suppressed = 0
        self._next = now + self.period_s
        self.log.warning(message, *args)
