"""How a loaded model holds its weights: the ``weights`` option of :func:`dflash_jax.load_target`,
:func:`dflash_jax.load_drafter` and ``--weights``.

``"quantized"`` keeps a quantized checkpoint's weights quantized (:mod:`dflash_jax.nn.quant`),
``"float"`` dequantizes them on load, ``"int8"`` quantizes a float checkpoint's weights to int8
on load; ``"auto"`` (the default) is :func:`resolve`'s rule, stated in docs/models.md ("Quantized
weights"): a quantized checkpoint stays quantized, unless a measurement in BENCHMARKS.md shows
float decoding faster at the same memory on the backend in use (:data:`FLOAT_FASTER`) and the
float weights fit in that backend's free memory. A family loader (the ``load_gguf`` / ``load_hf``
of :mod:`dflash_jax.families.registry`, a drafter loader) that takes a ``weights`` keyword can
load a choice other than ``"float"``; ``"auto"`` falls back to float for one that cannot.
"""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path

import jax
import numpy as np

from dflash_jax.errors import DFlashError

WEIGHTS = ("auto", "quantized", "float", "int8")
FLOAT_TYPES = ("F32", "F16", "BF16")

# backend -> the BENCHMARKS.md measurement that shows float decoding faster than quantized there
# (the reason "auto" dequantizes on that backend when the float weights fit). Empty: quantized wins
# or nothing was measured.
FLOAT_FASTER: dict[str, str] = {
    "cpu": "BENCHMARKS.md, 'Quantized weights against float (CPU)': DFlash (the default run) decodes as fast or faster "
           "in float32 on XLA:CPU (plain decoding is faster quantized)",
}


def check(weights) -> str:
    """``weights`` when it is one of :data:`WEIGHTS`; DFlashError naming the option otherwise."""
    if weights not in WEIGHTS:
        raise DFlashError("weights (--weights)", f"unsupported value {weights!r}", f"one of {', '.join(WEIGHTS)}")
    return weights


def quantized_checkpoint(p: Path) -> bool:
    """Whether the checkpoint ``p`` stores weights quantized: a ``.gguf`` file with a tensor of a
    type other than F32/F16/BF16 (read from its float32 cache's record when there is one, so a
    cached file is not parsed), or a folder whose ``config.json`` has a ``quantization_config``."""
    p = Path(p)
    if p.is_file() and p.suffix.lower() == ".gguf":
        from dflash_jax.families.dense.gguf_cache import cache_info
        from dflash_jax.formats.gguf_file import open_gguf

        info = cache_info(str(p))
        if info is not None and "quantized" in info:
            return bool(info["quantized"])
        return any(t.tensor_type.name not in FLOAT_TYPES for t in open_gguf(p).tensors)
    config = p / "config.json"
    if p.is_dir() and config.is_file():
        from dflash_jax.families.hf_config import read_json

        return "quantization_config" in read_json(config)
    return False


def takes_weights(fn) -> bool:
    """Whether a loader takes the ``weights`` keyword (so it can load more than float weights)."""
    try:
        return "weights" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def float_nbytes(p: Path, dtype: str) -> int:
    """The bytes the checkpoint's weights take dequantized to ``dtype``: a GGUF's element count
    times the dtype's size (its float32 cache's size, scaled, when there is one); a folder's safetensors bytes times it (one byte per quantized weight
    assumed: an upper bound for 4-bit checkpoints, exact for FP8)."""
    size = np.dtype(jax.numpy.dtype(dtype)).itemsize
    p = Path(p)
    if p.is_file():
        from dflash_jax.families.dense.gguf_cache import cache_info, cache_path
        from dflash_jax.formats.gguf_file import open_gguf

        if cache_info(str(p)) is not None:  # its float32 cache holds every weight: no parse
            return size * sum(f.stat().st_size for f in cache_path(p).glob("*.npy")) // 4

        return size * sum(int(np.prod([int(d) for d in t.shape])) for t in open_gguf(p).tensors)
    return size * sum(f.stat().st_size for f in p.glob("*.safetensors"))


def free_memory(backend: str) -> int | None:
    """Bytes free for weights on ``backend``: the host's ``MemAvailable`` on the CPU, the first
    device's ``bytes_limit - bytes_in_use`` elsewhere; ``None`` when it cannot be told."""
    if backend == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else None
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return None


def resolve(weights: str, p: Path, dtype: str, can_quantize=True) -> str:
    """The choice ``"quantized"``, ``"float"`` or ``"int8"`` that loading ``p`` under ``weights`` makes.

    ``"auto"``: ``"quantized"`` for a quantized checkpoint whose family loader can keep it so
    (``can_quantize``: a bool, or a function asked only then), unless the backend in use is in :data:`FLOAT_FASTER` and
    :func:`float_nbytes` fits in :func:`free_memory`; ``"float"`` otherwise. ``"quantized"`` for a
    float checkpoint is ``"float"`` (nothing to keep). Raises DFlashError for a value outside
    :data:`WEIGHTS`.
    """
    check(weights)
    if weights in ("float", "int8"):
        return weights
    if not quantized_checkpoint(p):
        return "float"
    if weights == "quantized":
        return "quantized"
    if not (can_quantize() if callable(can_quantize) else can_quantize):
        return "float"
    backend = jax.default_backend()
    if backend in FLOAT_FASTER:
        free = free_memory(backend)
        if free is not None and float_nbytes(p, dtype) <= free:
            return "float"
    return "quantized"


def loader(fn, weights: str, explicit: bool, p: Path, dtype: str):
    """``(load, choice)``: the drafter loader ``fn`` bound to the resolved ``weights`` for the
    checkpoint ``p``, and that choice. A loader without a ``weights`` keyword loads float: fine
    when the choice follows the target's (``explicit`` false) or is float anyway; an explicit
    other choice raises DFlashError naming ``weights`` and the file."""
    choice = resolve(weights, p, dtype, can_quantize=takes_weights(fn))
    if takes_weights(fn):
        return functools.partial(fn, weights=choice), choice
    if choice != "float" and explicit:
        raise DFlashError("weights (--weights)", f"{choice!r} is not supported for the drafter {p}", "float")
    return fn, "float"
