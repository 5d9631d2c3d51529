"""Atomic file writes (text, ``.npy``, safetensors): a file is either absent, the old version or
the complete new one."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

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
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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


_ST_DTYPES = {
    np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float64): "F64", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64", np.dtype(np.uint32): "U32",
    np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8", np.dtype(np.uint16): "U16", np.dtype(np.int16): "I16",
}


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> Path:
    """Writes a safetensors file atomically (temporary file, fsync, rename).

    Format: 8-byte little-endian header length, a JSON header
    ``{name: {dtype, shape, data_offsets}, "__metadata__": {...}}`` padded with spaces to a
    multiple of 8, then the little-endian tensor bytes in header order. bfloat16 goes through
    ``ml_dtypes`` (safetensors' numpy API has no bfloat16).

    Args:
      tensors: name -> array (float32/16, bfloat16, float64, signed/unsigned ints); 0-d allowed.
      metadata: string -> string.
    Raises:
      DFlashError: an unsupported dtype (names the tensor).
    """
    path = Path(path)
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs, off = [], 0
    for name in tensors:
        a = np.asarray(tensors[name])
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # np.ascontiguousarray would turn a 0-d array into 1-d
        code = _ST_DTYPES.get(a.dtype)
        if code is None:
            raise DFlashError(f"{path}: tensor {name}", f"unsupported dtype {a.dtype}", "a float or integer dtype")
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)
    return path
