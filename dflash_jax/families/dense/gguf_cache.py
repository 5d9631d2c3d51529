"""The float32 weight cache of a dense GGUF target: the folder ``<file>.f32/`` next to the GGUF,
keyed by the GGUF's size and mtime, so a second load skips parsing and dequantizing it.

The folder holds one ``.npy`` file per parameter leaf (``embed.npy``, ``layers.wq.npy``, ...;
numpy's format, no pickles, data 64-byte aligned) and ``meta.json`` (format, source key, the
GGUF's ``general.architecture``, the float32 config and the weights' fingerprint,
:mod:`dflash_jax.runtime.fingerprint`). A load memory-maps the ``.npy`` files instead of reading them, and
JAX on the CPU uses 64-byte-aligned host memory as it is, so the weights are paged in when first
used rather than copied at load. A stale or damaged cache is rebuilt, never trusted; the folder
is replaced whole (written beside it, then renamed), so a process that has it mapped keeps its
copy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any
import jax
import numpy as np
from dflash_jax.families.hf_config import RopeConfig
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.formats.files import cache_key, save_npy, umasked, write_text
from dflash_jax.families.dense.model import MODEL


_CACHE_FORMAT = "dflash_jax.gguf.f32/2"
_CACHE_SUFFIX = ".f32"
_LEGACY_SUFFIX = ".f32.safetensors"  # format 1 (read into memory at every load), removed when format 2 is written
_META = "meta.json"


def cache_path(path: str | os.PathLike) -> Path:
    """Where the float32 cache of ``path`` lives: the folder ``<path>.f32``."""
    return Path(str(path) + _CACHE_SUFFIX)


def _flatten(params: dict) -> dict[str, np.ndarray]:
    flat = {k: v for k, v in params.items() if k != "layers"}
    flat.update({f"layers.{k}": v for k, v in params["layers"].items()})
    return flat


def _cfg_from_dict(d: dict) -> TargetConfig:
    return TargetConfig(**dict(d, rope=RopeConfig(**d["rope"])))


def cache_info(path: str) -> dict | None:
    """The ``meta.json`` of the current cache of the GGUF ``path`` (``architecture``, ``config``,
    ``fingerprint``, ...), or ``None`` when there is none or it is of another format or source
    (size, mtime). Reads one small file: cheap enough to ask before opening the GGUF."""
    try:
        meta = json.loads((cache_path(path) / _META).read_text(encoding="utf-8"))
        if meta.get("format") == _CACHE_FORMAT and meta.get("source_key") == cache_key(path):
            return meta
    except (OSError, ValueError):
        pass
    return None


def read_cache(path: str) -> tuple[TargetConfig, dict, dict] | None:
    """``(float32 cfg, params, meta)`` from the cache of the GGUF ``path``, or ``None`` when there
    is none or it is stale (another size or mtime), damaged or of other shapes.

    ``params`` is the :mod:`dflash_jax.families.dense.model` pytree of read-only, memory-mapped float32
    ``np.ndarray`` leaves (nothing is read until used); ``meta`` is :func:`cache_info`'s dict.
    """
    meta = cache_info(path)
    if meta is None:
        return None
    folder = cache_path(path)
    try:
        cfg = _cfg_from_dict(meta["config"])
        params: dict[str, Any] = {"layers": {}}
        for name, shape in _flatten(MODEL.param_shapes(cfg)).items():
            a = np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False)
            if a.dtype != np.float32 or a.shape != tuple(shape):
                return None
            if name.startswith("layers."):
                params["layers"][name[len("layers."):]] = a
            else:
                params[name] = a
        return cfg, params, meta
    except Exception:  # missing, truncated or damaged files: the cache is rebuilt, never trusted
        return None


def write_cache(path: str, cfg: TargetConfig, params: dict, architecture: str, fingerprint: str,
                quantized: bool | None = None) -> None:
    """Writes the float32 ``params`` of the GGUF ``path`` to its cache folder (in a temporary
    folder beside it, then renamed into place) and removes a format-1 ``<path>.f32.safetensors``.
    ``quantized``: whether the GGUF holds quantized tensors, recorded in ``meta.json`` (so
    ``weights="auto"`` need not parse the GGUF to tell, :mod:`dflash_jax.weights_choice`).
    A failure to write is reported on stderr and otherwise ignored (loading still works).
    """
    folder = cache_path(path)
    meta = dict(format=_CACHE_FORMAT, source_key=cache_key(path), architecture=architecture,
                config=dataclasses.asdict(cfg.with_dtype("float32")), fingerprint=fingerprint)
    if quantized is not None:
        meta["quantized"] = bool(quantized)
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", suffix=".tmp", dir=str(folder.parent)))
        os.chmod(tmp, umasked(0o777))
        for name, a in _flatten(params).items():
            save_npy(tmp / f"{name}.npy", np.asarray(a, np.float32))
        write_text(tmp / _META, json.dumps(meta, sort_keys=True))
        _replace_folder(tmp, folder)
        tmp = None
        Path(str(path) + _LEGACY_SUFFIX).unlink(missing_ok=True)
    except OSError as e:  # read-only directory, full disk: loading still works, just slower next time
        print(f"dflash_jax: could not write the weight cache {folder} ({e})", file=sys.stderr)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _replace_folder(new: Path, folder: Path) -> None:
    """Renames ``new`` to ``folder``, moving an existing ``folder`` aside first and deleting it
    after (files that another process has memory-mapped stay valid for it)."""
    old = None
    if folder.exists():
        old = Path(tempfile.mkdtemp(prefix=folder.name + ".", suffix=".old", dir=str(folder.parent)))
        os.replace(folder, old / "cache")
    os.replace(new, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def cache_nbytes(params: dict) -> int:
    """Bytes of the float32 copy of ``params`` (what :func:`write_cache` writes)."""
    return sum(4 * int(np.prod(np.shape(a))) for a in jax.tree_util.tree_leaves(params))
