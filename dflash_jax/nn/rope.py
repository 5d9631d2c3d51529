"""Rotary position embeddings (rotate-half / NeoX convention, as in transformers).

Frequencies are computed in NumPy at trace time from the static :class:`RopeConfig`, so they are
constants in the compiled program. Source: transformers ``modeling_rope_utils`` (default, linear,
llama3) and ``apply_rotary_pos_emb``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from dflash_jax.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies ``[rot_dim // 2]`` float64 for the rotating part of a head."""
    rot_dim = int(head_dim * rope.partial)
    rot_dim -= rot_dim % 2
    inv = 1.0 / (rope.theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim))
    if rope.kind == "linear":
        inv = inv / rope.factor
    elif rope.kind == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(mid, (1 - smooth) * inv / rope.factor + smooth * inv, scaled)
    return inv


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> jnp.ndarray:
    """Rotates the first ``2 * len(inv_freq)`` channels of each head of ``x``.

    Args:
      x: ``[B, T, heads, head_dim]``.
      positions: ``[B, T]`` int32 absolute positions.
      inv_freq: ``[rot_dim // 2]`` from :func:`inv_frequencies`.
      scale: multiplies cos and sin (YaRN attention factor; 1.0 otherwise).
    Returns:
      ``[B, T, heads, head_dim]`` in ``x.dtype``; channels past ``rot_dim`` pass through.
    """
    rot = 2 * inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B,T,rot/2]
    cos = (jnp.cos(angles) * scale)[:, :, None, :]
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    xr = x[..., :rot].astype(jnp.float32)
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    if rot == x.shape[-1]:
        return out
    return jnp.concatenate([out, x[..., rot:]], axis=-1)
