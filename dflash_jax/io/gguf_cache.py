"""The float32 weight cache of a dense GGUF target: ``<file>.f32.safetensors`` next to the GGUF,
keyed by the GGUF's size and mtime, so a second load skips the dequantization. Nothing is pickled;
a stale or damaged cache is rebuilt, never trusted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from dflash_jax.config import RopeConfig, TargetConfig
from dflash_jax.io.files import atomic_path
from dflash_jax.models.dense import param_shapes

_CACHE_FORMAT = "dflash_jax.gguf.f32/1"
_CACHE_SUFFIX = ".f32.safetensors"


def cache_path(path: str | os.PathLike) -> Path:
    """Where the float32 cache of ``path`` lives: ``<path>.f32.safetensors``."""
    return Path(str(path) + _CACHE_SUFFIX)


def cache_key(path: str) -> str:
    """``"<size>:<mtime_ns>"`` of a file: what a cache built from it is keyed by."""
    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}"


def _flatten(params: dict) -> dict[str, np.ndarray]:
    flat = {k: v for k, v in params.items() if k != "layers"}
    flat.update({f"layers.{k}": v for k, v in params["layers"].items()})
    return flat


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    params: dict[str, Any] = {"layers": {}}
    for k, v in flat.items():
        if k.startswith("layers."):
            params["layers"][k[len("layers."):]] = v
        else:
            params[k] = v
    return params


def _cfg_to_json(cfg: TargetConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


def _cfg_from_json(text: str) -> TargetConfig:
    d = json.loads(text)
    d["rope"] = RopeConfig(**d["rope"])
    return TargetConfig(**d)


def read_cache(path: str) -> tuple[TargetConfig, dict] | None:
    """``(float32 cfg, numpy params)`` from the cache of the GGUF ``path``, or ``None`` when there is
    none or it is stale (another size or mtime), damaged or of other shapes."""
    cpath = cache_path(path)
    if not cpath.is_file():
        return None
    try:
        with safe_open(str(cpath), framework="numpy") as f:
            meta = f.metadata() or {}
        if meta.get("format") != _CACHE_FORMAT or meta.get("source_key") != cache_key(path):
            return None
        cfg = _cfg_from_json(meta["config"])
        params = _unflatten(load_file(str(cpath)))
        want = param_shapes(cfg)
        got = jax.tree_util.tree_map(lambda a: tuple(a.shape), params)
        if jax.tree_util.tree_structure(want, is_leaf=lambda x: isinstance(x, tuple)) != jax.tree_util.tree_structure(
            got, is_leaf=lambda x: isinstance(x, tuple)
        ) or want != got:
            return None
        return cfg, params
    except Exception:  # a stale or damaged cache is rebuilt, never trusted
        return None


def write_cache(path: str, cfg: TargetConfig, params: dict) -> None:
    """Writes the float32 ``params`` of the GGUF ``path`` to its cache (atomically); a failure to
    write is reported on stderr and otherwise ignored."""
    cpath = cache_path(path)
    meta = {"format": _CACHE_FORMAT, "source_key": cache_key(path), "config": _cfg_to_json(cfg.with_dtype("float32"))}
    try:
        with atomic_path(cpath) as tmp:
            save_file(_flatten(params), str(tmp), metadata=meta)
    except OSError as e:  # read-only directory, full disk: loading still works, just slower next time
        print(f"dflash_jax: could not write the weight cache {cpath} ({e})", file=sys.stderr)
