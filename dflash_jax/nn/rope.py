"""Rotary position embeddings (rotate-half / NeoX convention, as in transformers).

Frequencies are computed in NumPy at trace time from the static
:class:`~dflash_jax.config.RopeConfig`, so they are constants in the compiled program; every
family (dense, Laguna, the drafters) uses the same functions. Source: transformers
``modeling_rope_utils`` (default, linear, llama3, yarn) and ``apply_rotary_pos_emb``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from dflash_jax.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies ``[rot // 2]`` float64 for the rotating part of a head.

    ``rot = int(head_dim * rope.partial)`` rounded down to even; default ``theta^(-2j/rot)``.
    ``linear`` divides by ``factor``; ``llama3`` scales long wavelengths (Llama 3.1); ``yarn`` as
    transformers ``_compute_yarn_parameters`` with ``dim = rot`` (correction range floored/ceiled
    when ``truncate``, linear ramp, ``low == high`` nudged by 0.001). The YaRN cos/sin scale is
    :func:`yarn_scale`'s.
    """
    rot = int(head_dim * rope.partial)
    rot -= rot % 2
    inv = 1.0 / (rope.theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        return _llama3(rope, inv)
    if rope.kind == "yarn":
        return _yarn(rope, inv, rot)
    return inv


def _llama3(rope: RopeConfig, inv: np.ndarray) -> np.ndarray:
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(mid, (1 - smooth) * inv / rope.factor + smooth * inv, scaled)


def _yarn(rope: RopeConfig, inv: np.ndarray, rot: int) -> np.ndarray:
    def corr(n_rot):
        return rot * math.log(rope.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = corr(rope.beta_fast), corr(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rot // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrap = 1 - ramp
    return (inv / rope.factor) * (1 - extrap) + inv * extrap


def yarn_scale(rope: RopeConfig, rule: str = "transformers") -> float:
    """The factor multiplying cos and sin (1.0 unless ``rope.kind == "yarn"``).

    ``rule="transformers"``: the config's ``attention_factor`` when present, else
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given, else
    ``0.1 ln(factor) + 1`` (transformers ``_compute_yarn_parameters``). ``"derived"``: always
    ``0.1 ln(factor) + 1`` (vLLM ``get_rope``). Applied once, never squared (docs/specs/laguna.md 9.1).
    """
    if rope.kind != "yarn":
        return 1.0

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rule == "transformers" and rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rule == "transformers" and rope.mscale and rope.mscale_all_dim:
        return float(get_mscale(rope.factor, rope.mscale) / get_mscale(rope.factor, rope.mscale_all_dim))
    return float(get_mscale(rope.factor))


def rope_tables(rope: RopeConfig, head_dim: int, rule: str = "transformers") -> tuple[np.ndarray, float]:
    """``(inv_freq [rot/2] float64, cos/sin scale)``: :func:`inv_frequencies` and :func:`yarn_scale`."""
    return inv_frequencies(rope, head_dim), yarn_scale(rope, rule)


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
