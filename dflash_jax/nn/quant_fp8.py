"""Block-scaled FP8 weights (format ``"fp8_block"``), as Qwen3-*-FP8 and DeepSeek-V3 ship them.

**The checkpoint.** ``config.json`` says ``quantization_config: {quant_method: "fp8", fmt: "e4m3",
weight_block_size: [bo, bi], activation_scheme: "dynamic"}`` (``[128, 128]`` in every published
one); a linear weight ``W [out, in]`` is stored as ``float8_e4m3fn`` codes ``[out, in]`` beside
``<name>_scale_inv`` float ``[ceil(out / bo), ceil(in / bi)]``, one scale per ``bo x bi`` block, and
the weight is ``codes * scale_inv`` of its block (DeepSeek-V3 ``inference/kernel.py``
``weight_dequant``: ``y = x * s``; the last blocks of a row or column may be partial).

**The fields** (the :class:`~dflash_jax.nn.quant.QuantizedWeight` convention ``[*lead, out, k]``):
``codes`` ``float8_e4m3fn [*lead, out, in]`` (one byte a weight, the checkpoint's bytes) and
``scale`` ``float32 [*lead, out, ceil(in / bi)]``: each block row of scales repeated for its ``bo``
output rows (:func:`fields_from_checkpoint`), so the block height is gone from the layout and only
the block width ``bi`` is part of the format: ``"fp8_block"`` for ``bi = 128``,
``"fp8_block_<bi>"`` for another width (registered on first use, :func:`format_name`).

**Weight-only.** Activations stay in the model's float dtype: the checkpoint's ``activation_scheme:
"dynamic"`` (per-token FP8 quantization of the activations before each matmul, on hardware with
FP8 units) is not emulated, so our logits are those of the dequantized weights in float, the
oracle the tests use (transformers on the dequantized weights).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dflash_jax.errors import DFlashError
from dflash_jax.nn import quant

BLOCK_IN = 128  # the block width of every published block-scaled FP8 checkpoint
CODE_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)


def format_name(block_in: int = BLOCK_IN) -> str:
    """The registered format for blocks ``block_in`` wide along ``in`` (registered on first use)."""
    name = "fp8_block" if block_in == BLOCK_IN else f"fp8_block_{block_in}"
    if name not in quant.FORMATS:
        quant.register(quant.QuantFormat(name, _in_features, lambda f, dtype: _dequantize(f, dtype, block_in)))
    return name


def _in_features(f) -> int:
    return f["codes"].shape[-1]


def _dequantize(f, dtype, block_in: int):
    """``codes * scale`` of each weight's block -> ``[..., out, in]`` in ``dtype`` (float32 products)."""
    codes, scale = f["codes"].astype(jnp.float32), f["scale"].astype(jnp.float32)
    n, nb = codes.shape[-1], scale.shape[-1]
    if n == nb * block_in:  # whole blocks: a broadcast over [.., nb, bi]
        w = (codes.reshape(codes.shape[:-1] + (nb, block_in)) * scale[..., None]).reshape(codes.shape)
    else:  # a partial last block: each scale repeated over its block, cut at in
        w = codes * jnp.repeat(scale, block_in, axis=-1, total_repeat_length=nb * block_in)[..., :n]
    return w.astype(dtype)


def check_scale_shape(codes_shape: tuple, scale_shape: tuple, block: tuple, where: str) -> None:
    """Raises DFlashError naming ``where`` unless ``scale_shape == (ceil(out / bo), ceil(in / bi))``
    for codes ``[out, in]`` and ``block = (bo, bi)``."""
    out, n = codes_shape[-2:]
    want = (-(-out // block[0]), -(-n // block[1]))
    if tuple(scale_shape) != want:
        raise DFlashError(where, f"shape {tuple(scale_shape)} for FP8 codes {tuple(codes_shape)}",
                          f"{want}: one scale per {block[0]} x {block[1]} block (weight_block_size)")


def fields_from_checkpoint(codes: np.ndarray, scale_inv: np.ndarray, block: tuple) -> dict:
    """The fields of one weight from its checkpoint tensors (numpy, at load time).

    Args:
      codes: ``float8_e4m3fn [out, in]`` (as stored; any leading axes pass through).
      scale_inv: float ``[ceil(out / bo), ceil(in / bi)]``.
      block: ``weight_block_size`` ``(bo, bi)``.
    Returns:
      ``{"codes": codes, "scale": float32 [out, ceil(in / bi)]}`` (each block row repeated for its
      ``bo`` output rows).
    """
    out = codes.shape[-2]
    scale = np.repeat(np.asarray(scale_inv, np.float32), block[0], axis=-2)[..., :out, :]
    return {"codes": np.asarray(codes).view(CODE_DTYPE), "scale": scale}


def dequantize_np(codes: np.ndarray, scale_inv: np.ndarray, block: tuple) -> np.ndarray:
    """The float32 weight ``[out, in]`` of FP8 ``codes [out, in]`` and the checkpoint's
    ``scale_inv [ceil(out / bo), ceil(in / bi)]`` (numpy, for ``weights="float"`` loads)."""
    out, n = codes.shape[-2:]
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block[0], axis=-2), block[1], axis=-1)[..., :out, :n]
    return np.asarray(codes).view(CODE_DTYPE).astype(np.float32) * s


format_name()  # "fp8_block"
