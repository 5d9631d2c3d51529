"""Int8 weight-only quantization of a float checkpoint at load (format ``"int8"``, ``weights="int8"``).

**The scheme.** Symmetric absmax: each group of a weight's row gets ``scale = max |w| / 127`` and
codes ``round(w / scale)`` in ``[-127, 127]``, so the dequantized ``codes * scale`` is within half a
step (``scale / 2``) of the float weight. A group is ``GROUP`` = 128 weights along ``in`` (the
default; the last group of a row may be partial) or a whole output row (:func:`quantize`'s
``group=None``: per output channel).

**The fields** (the :class:`~dflash_jax.nn.quant.QuantizedWeight` convention ``[*lead, out, k]``):
``codes`` ``int8 [*lead, out, in]`` (one byte a weight) and ``scale`` ``float32 [*lead, out, g]``:
``g == ceil(in / 128)``, one scale per group of 128, or ``g == 1``, one per row. One format holds
both: a single group spans the row whatever its width.

**Per group of 128, measured** (this CPU: XLA:CPU, jax 0.10.2, 2 cores shared with other jobs,
alternating in one process, 2026-12-06; BENCHMARKS.md "Int8 weight-only on this CPU"). Over the
default model's layer weights, per-group codes have a relative RMS error of 0.69 % (max 0.87 %)
against 0.85 % (max 1.16 %) per channel. Plain greedy decoding of the default model took, per
token, 95 / 112 / 108 ms (per group / per channel / float32) in one run and 77 / 82 / 65 ms in
another (load 7 on 2 cores: only the order within a run means anything): per group was the faster
int8 in both, and both decode the same 64 greedy tokens as float32 there. Over 8 prompts x 32
greedy tokens, 185 of 256 agreed with float32's before the first difference per group and 204 per
channel, each losing different prompts at near-ties (tests/test_quant_safetensors.py). So per
group of 128 is the default: the smaller weight error, and not slower. Against float32 int8 buys memory (a quarter of the bytes),
not speed, on XLA:CPU: timed alone, a one-token product of a dequantized ``[4096, 4096]`` int8
weight took 15.8 ms against float32's 1.8 ms (the int8 matrix is converted to a float32 one in
memory before the product); a backend with int8 or fused dequantizing matmuls (GPU) is where it can
gain both.

**qwix, judged.** qwix (Google's JAX quantization library, PyPI ``qwix`` 0.1.8) does weight-only
int8 (per channel and sub-channel) and more, but it quantizes *Flax* models: its providers
intercept ``dot_general`` / ``einsum`` inside Flax Linen / NNX modules, chosen by rules on the
modules' paths, and keep the quantized weights in the Flax variable tree. Our models are pure
functions over dicts of arrays, with no module paths for its rules to match, and the weights must
come out of the checkpoint reader already quantized (a float copy of the whole model is what this
issue removes) in the :class:`~dflash_jax.nn.quant.QuantizedWeight` fields every format shares
(GGUF blocks, FP8 blocks). Adopting it would add qwix and Flax for the dozen lines of
:func:`quantize`; so these lines are our own, to be revisited if the models become Flax modules.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dflash_jax.errors import DFlashError
from dflash_jax.nn import quant

NAME = "int8"
GROUP = 128  # the width of a group when a row has several


def quantize(w: np.ndarray, group: int | None = GROUP) -> dict:
    """Int8 fields of a float weight (numpy, at load time).

    Args:
      w: float ``[out, in]`` (the checkpoint's row order).
      group: :data:`GROUP` (the default) or ``None`` (one scale per output row).
    Returns:
      ``{"codes": int8 [out, in], "scale": float32 [out, g]}``; an all-zero group gets scale 0 and
      codes 0.
    Raises:
      DFlashError: ``group`` neither ``None`` nor :data:`GROUP`, or ``w`` not 2-D.
    """
    if group not in (None, GROUP):
        raise DFlashError("int8 group", f"got {group!r}", f"None (per output channel) or {GROUP}")
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise DFlashError("int8 weight", f"shape {w.shape}", "a 2-D [out, in] weight")
    out, n = w.shape
    g = n if group is None else group
    nb = -(-n // g)
    blocks = np.pad(w, ((0, 0), (0, nb * g - n))).reshape(out, nb, g)
    scale = np.abs(blocks).max(axis=-1) / np.float32(127)
    codes = np.rint(blocks / np.where(scale > 0, scale, 1)[..., None])
    codes = np.clip(codes, -127, 127).astype(np.int8).reshape(out, nb * g)[:, :n]
    return {"codes": codes, "scale": scale.astype(np.float32)}


def _in_features(f) -> int:
    return f["codes"].shape[-1]


def _dequantize(f, dtype):
    """``codes * scale`` -> ``[..., out, in]`` in ``dtype`` (float32 products)."""
    codes, scale = f["codes"].astype(jnp.float32), f["scale"].astype(jnp.float32)
    n, nb = codes.shape[-1], scale.shape[-1]
    if nb == 1:
        w = codes * scale
    elif n == nb * GROUP:
        w = (codes.reshape(codes.shape[:-1] + (nb, GROUP)) * scale[..., None]).reshape(codes.shape)
    else:
        w = codes * jnp.repeat(scale, GROUP, axis=-1, total_repeat_length=nb * GROUP)[..., :n]
    return w.astype(dtype)


quant.register(quant.QuantFormat(NAME, _in_features, _dequantize))
