"""API keys: who may call the gateway's public services, and for which models.

With ``--api-keys-file``, every call of berth.v1 and KServe must carry
metadata ``authorization: Bearer KEY`` with a key of the file; health and
reflection stay open. The file holds one key per line, optionally followed
by the models it may use (``KEY model1,model2``); blank lines and ``#``
comments are ignored. It is read again on SIGHUP and when it changes
(checked at most once a second, on the request path); a file that cannot be
read or is not valid leaves the keys as they were and the log says why.

A call's caller (:data:`CALLER`) is set where the call is read
(gateway/intake.py) and holds for the whole call, streams included, so the
per-model check (:func:`allow`) and the response cache's tenant
(gateway/calls.py ``tenant_of``) need no context passed down.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import logging
import os
import signal
import time
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import grpc

from gateway.echo import quoted
from services.config import add_flag
from services.errors import BerthError

log = logging.getLogger("berth.gateway")

MIN_KEY_CHARS = 16
# How often the request path looks whether the file changed.
RECHECK_S = 1.0
UNAUTHENTICATED = "missing or invalid API key"


class Unauthenticated(BerthError):
    """No key, or not one of the file's."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class PermissionDenied(BerthError):
    """A key used for a model it may not use."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class KeysFileError(ValueError):
    """An API keys file that cannot be used; says which line and why."""


@dataclass(frozen=True)
class Caller:
    """Who a call comes from: its tenant (keeps its cache entries apart) and
    the models its key may use (None: every model)."""

    tenant: str = ""
    models: frozenset[str] | None = None


ANYONE = Caller()
CALLER: ContextVar[Caller] = ContextVar("berth_caller", default=ANYONE)


@dataclass(frozen=True)
class _Key:
    digest: bytes
    caller: Caller


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str, source: str) -> list[_Key]:
    """The keys of a keys file's ``text``; raises KeysFileError naming the
    line of the first problem (never quoting a key)."""
    keys: list[_Key] = []
    seen: set[bytes] = set()
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{source} line {number}"
        if len(words) > 2:
            raise KeysFileError(
                f"{where}: expected KEY or KEY model1,model2, found {len(words)} words"
            )
        key = words[0]
        if len(key) < MIN_KEY_CHARS:
            raise KeysFileError(
                f"{where}: the key has {len(key)} characters; an API key needs "
                f"at least {MIN_KEY_CHARS}"
            )
        models = None
        if len(words) == 2:
            models = frozenset(m for m in words[1].split(",") if m)
            if not models:
                raise KeysFileError(f"{where}: no model names after the key")
        digest = _digest(key)
        if digest in seen:
            raise KeysFileError(f"{where}: the same key as an earlier line")
        seen.add(digest)
        keys.append(_Key(digest, Caller(digest.hex()[:16], models)))
    if not keys:
        raise KeysFileError(
            f"{source} holds no keys: every call would be refused (to serve "
            "without keys, start without --api-keys-file)"
        )
    return keys


def _stamp(path: Path) -> tuple[int, int, int]:
    stat = os.stat(path)
    return (stat.st_mtime_ns, stat.st_size, stat.st_ino)


class ApiKeys:
    """The keys of one file, kept up to date with it."""

    def __init__(self, path: str | Path) -> None:
        """Reads the file; raises KeysFileError when it cannot be used."""
        self.path = Path(path)
        try:
            self._stamp = _stamp(self.path)
            self._keys = parse_keys(self.path.read_text(), str(self.path))
        except OSError as exc:
            raise KeysFileError(f"cannot read {self.path}: {exc.strerror}") from None
        self._checked = time.monotonic()

    def __len__(self) -> int:
        return len(self._keys)

    def reload(self) -> bool:
        """Read the file again; on failure keep the keys and log why."""
        try:
            stamp = _stamp(self.path)
            keys = parse_keys(self.path.read_text(), str(self.path))
        except (OSError, UnicodeDecodeError, KeysFileError) as exc:
            log.error("API keys not reloaded, the old keys stay: %s", exc)
            return False
        self._stamp, self._keys = stamp, keys
        log.info("API keys reloaded: %d keys from %s", len(keys), self.path)
        return True

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < RECHECK_S:
            return
        self._checked = now
        try:
            changed = _stamp(self.path) != self._stamp
        except OSError as exc:
            log.error("API keys file %s: %s; the old keys stay", self.path, exc)
            return
        if changed:
            self.reload()

    def caller(self, metadata: Iterable[tuple[str, str | bytes]]) -> Caller:
        """The caller whose key the call's metadata carries; raises
        Unauthenticated. Every key is compared, in constant time."""
        self._maybe_reload()
        token = _bearer(metadata)
        if token is None:
            raise Unauthenticated(UNAUTHENTICATED)
        digest = _digest(token)
        found = None
        for key in self._keys:
            if hmac.compare_digest(digest, key.digest) and found is None:
                found = key.caller
        if found is None:
            raise Unauthenticated(UNAUTHENTICATED)
        return found


def _bearer(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The token of the call's first ``authorization: Bearer`` entry."""
    for name, value in metadata:
        if name != "authorization":
            continue
        if isinstance(value, bytes):
            return None
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return token.strip()
    return None


def allow(model: str) -> None:
    """Raise PermissionDenied unless this call's key may use ``model``."""
    models = CALLER.get().models
    if models is not None and model not in models:
        raise PermissionDenied(f"this API key may not use model {quoted(model)}")


def allowed(model: str) -> bool:
    """Whether this call's key may use ``model`` (lists show only these)."""
    models = CALLER.get().models
    return models is None or model in models


def add_keys_flag(parser: argparse.ArgumentParser) -> None:
    """The gateway's --api-keys-file."""
    add_flag(
        parser,
        "api-keys-file",
        "",
        "file of API keys, one a line, optionally KEY model1,model2: calls "
        "must send metadata 'authorization: Bearer KEY' (health and reflection "
        "stay open); re-read on SIGHUP and when it changes ('': no keys)",
    )


def keys_of(parser: argparse.ArgumentParser, path: str) -> ApiKeys | None:
    """The keys of --api-keys-file (None without one); a file that cannot
    be used is a usage error naming why."""
    if not path:
        return None
    try:
        return ApiKeys(path)
    except (KeysFileError, UnicodeDecodeError) as exc:
        parser.error(f"--api-keys-file: {exc}")


def start_keys(keys: ApiKeys | None) -> None:
    """Say whether keys are on (never which), and re-read them on SIGHUP."""
    if keys is None:
        log.info("API keys off: every caller is served (--api-keys-file)")
        return
    log.info("API keys on: %d keys from %s", len(keys), keys.path)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, keys.reload)
