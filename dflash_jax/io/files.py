"""Atomic file writes: a file is either absent, the old version or the complete new one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """Yields a temporary path beside ``path``; when the block succeeds, the file written there
    is synced and atomically renamed to ``path`` (permissions as the umask gives new files).
    On an exception the temporary file is removed and ``path`` is untouched.

    Raises:
      OSError: the folder is not writable (from creating the temporary file) or the rename fails.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=suffix, dir=str(path.parent))
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
