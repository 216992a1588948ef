"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

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
