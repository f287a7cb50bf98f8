"""Files berth builds once and reuses (exports, engine caches, fallbacks):
written whole or not at all, durably, and checked before they are reused.

A file is written under a temporary name in its own directory, flushed to
disk, renamed over its final name, and the directory flushed too, so that a
crash or power loss leaves either the old file or the new one, never a
truncated one under the final name; a write that fails removes its
temporary file. A cached file that is reused has a sidecar
``<name>.sha256`` (``sha256sum`` format) written after it: a file whose
bytes no longer match it (a disk error, a partial copy, an edit) is
rebuilt rather than served.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger("berth.files")


def fsync_directory(directory: Path) -> None:
    """Flush ``directory``'s entries (a rename into it) to disk."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with path.open("rb+") as f:
        os.fsync(f.fileno())


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Have ``write`` write the file at the temporary path it is given, then
    put it in place at ``path`` (see the module's docstring). Whatever
    ``write`` raises is raised after the temporary file is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def write_bytes(path: Path, data: bytes) -> None:
    """``data`` to ``path`` with :func:`atomic_write`."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def move_into_place(parts: Iterable[Path], directory: Path) -> None:
    """Flush each of ``parts`` (files written elsewhere on the same file
    system), rename it into ``directory`` in the order given, then flush
    the directory: a reader that checks for the last part finds the others
    complete."""
    for part in parts:
        fsync_file(part)
        os.replace(part, directory / part.name)
    fsync_directory(directory)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def sidecar(path: Path) -> Path:
    return path.with_name(f"{path.name}.sha256")


def seal(path: Path, also: Iterable[Path] = ()) -> None:
    """Write ``path``'s sidecar: the sha256 of ``path`` and of each of
    ``also`` (files beside it that belong to it, an export's external data),
    once they are in place."""
    lines = [f"{sha256(p)}  {p.name}\n" for p in (*also, path)]
    write_bytes(sidecar(path), "".join(lines).encode())


def verified(path: Path, what: str) -> bool:
    """Whether ``path`` is there and matches its sidecar. A file that is
    there but does not match, or has no sidecar, is logged as ``what``
    about to be built again; a missing file is not worth a line."""
    if not path.is_file():
        return False
    try:
        lines = sidecar(path).read_text().splitlines()
    except (OSError, ValueError):  # (ValueError: not text)
        lines = []
    expected = {}
    for line in lines:
        digest, _, name = line.partition("  ")
        expected[name] = digest
    if path.name not in expected:
        log.warning("%s %s has no checksum beside it: building it again", what, path)
        return False
    for name, digest in expected.items():
        try:
            ok = sha256(path.parent / name) == digest
        except OSError:
            ok = False
        if not ok:
            log.warning(
                "%s %s does not match its checksum (%s): building it again",
                what,
                path,
                name,
            )
            return False
    return True
