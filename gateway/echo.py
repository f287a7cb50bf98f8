"""How much of a caller's input an error message may quote.

An error's message travels in the call's trailing metadata, which gRPC caps
(past ~16 KiB the caller sees RESOURCE_EXHAUSTED instead of the status
meant): every error that names what a caller sent quotes a short prefix.
"""

from __future__ import annotations

# Characters of a caller's string an error quotes before it cuts it short.
ECHO_CHARS = 64


def quoted(value: str | bytes) -> str:
    """``repr(value)``, or for a long value the repr of its first ECHO_CHARS
    characters followed by "… (N characters)"."""
    if len(value) <= ECHO_CHARS:
        return repr(value)
    unit = "bytes" if isinstance(value, bytes) else "characters"
    return f"{value[:ECHO_CHARS]!r}… ({len(value)} {unit})"


def shown(value: str) -> str:
    """``value`` itself when short, else :func:`quoted`'s short form (for a
    span attribute or a log line)."""
    return value if len(value) <= ECHO_CHARS else quoted(value)
