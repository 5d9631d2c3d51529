"""RMSNorm as in Llama/Qwen (``w * x / sqrt(mean(x^2) + eps)``, statistics in float32)."""

from __future__ import annotations

import jax.numpy as jnp


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """RMS-normalises the last axis of ``x`` and scales by ``weight``.

    Args:
      x: ``[..., D]`` any float dtype.
      weight: ``[D]``.
      eps: added to the mean square.
    Returns:
      ``[..., D]`` in ``x.dtype``. Follows transformers ``LlamaRMSNorm`` (float32 statistics,
      cast back before the weight multiply).
    """
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return (x32 * jnp.reciprocal(jnp.sqrt(var + eps))).astype(x.dtype) * weight.astype(x.dtype)
