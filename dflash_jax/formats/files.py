"""Atomic file writes (text, ``.npy``, safetensors): a file is either absent, the old version or
the complete new one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator, Mapping
import ml_dtypes
import numpy as np
import safetensors.numpy
from dflash_jax.errors import DFlashError


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
        os.chmod(tmp, umasked(0o666))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def umasked(mode: int) -> int:
    """``mode`` less the process umask: the permissions a newly created file or folder gets
    (``tempfile`` creates private ones)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Writes ``text`` (UTF-8) to ``path`` atomically; returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def save_npy(path: str | os.PathLike, arr: np.ndarray) -> Path:
    """Writes ``arr`` as a ``.npy`` file (no pickles) atomically; returns the path."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)
    return Path(path)


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> Path:
    """Writes a safetensors file atomically (temporary file, fsync, rename) with the
    ``safetensors`` library (numpy API; bfloat16 as ``ml_dtypes.bfloat16``).

    Args:
      tensors: name -> array (float32/16, bfloat16, float64, bool, signed/unsigned ints; any
        memory layout); 0-d allowed.
      metadata: string -> string.
    Returns:
      ``path``.
    Raises:
      DFlashError: an unsupported dtype (names the file and tensor).
    """
    path = Path(path)
    arrays = {}
    for name, value in tensors.items():
        a = np.asarray(value)
        if a.dtype.kind not in "biuf" and a.dtype != ml_dtypes.bfloat16:
            raise DFlashError(f"{path}: tensor {name}", f"unsupported dtype {a.dtype}", "a float, integer or bool dtype")
        arrays[name] = a
    meta = {str(k): str(v) for k, v in metadata.items()} if metadata else None
    with atomic_path(path) as tmp:
        safetensors.numpy.save_file(arrays, str(tmp), metadata=meta)
    return path


def cache_key(path: str) -> str:
    """``"<size>:<mtime_ns>"`` of a file: what a cache built from it is keyed by."""
    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}"
