"""Bounded waits: every loop that waits for something ends, and says what it
waited for when it gives up (a hang becomes a failure with a message)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def until(
    predicate: Callable[[], T],
    what: str,
    timeout_s: float = 10.0,
    poll_s: float = 0.005,
) -> T:
    """Poll ``predicate`` on the event loop until it is truthy; its value.

    Fails the test (AssertionError naming ``what``) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(poll_s)
    return value


def wait_until(
    predicate: Callable[[], T], what: str, timeout_s: float = 20.0, poll_s: float = 0.2
) -> T:
    """:func:`until` for a thread: sleeps between polls."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(poll_s)
    return value
