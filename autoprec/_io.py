"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from ._version import __version__

__all__ = ["atomic_write_text"]


def atomic_write_text(path: "str | os.PathLike", text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file fsynced and renamed over it.

    Creates missing parent folders. On any failure the previous file is intact and no temporary
    file is left behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    # Not tempfile.mkstemp: it creates the file 0600, and the rename would keep that mode,
    # leaving a file other users or workers cannot read. os.open honours the umask.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def check_schema_version(data, source: str, artifact: str, current: int, error: type, how_to_save: str) -> int:
    """The ``schema_version`` of a loaded artifact, or ``error`` saying what is wrong with it.

    ``artifact`` ("plan", "profile") and ``how_to_save`` go into the messages; versions newer than
    ``current`` ask for an upgrade.
    """
    version = data.get("schema_version")
    if version is None:
        raise error(f"{source}: no 'schema_version'; this is not an autoprec {artifact} ({how_to_save})")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise error(f"{source}: schema_version must be a positive integer, got {version!r}")
    if version > current:
        raise error(
            f"{source}: schema_version {version} is not supported by autoprec {__version__} "
            f"(it reads 1..{current}); upgrade autoprec to read newer {artifact}s"
        )
    return version
