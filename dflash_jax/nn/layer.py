"""The pieces of a pre-norm decoder layer that every model here shares (dense targets, Laguna,
both drafters), over one layer's parameter dict ``lp`` (leaf names of
:func:`dflash_jax.models.params.decoder_layer`, ``[in, out]`` weights).

Per layer: ``h = rms(x; attn_norm)``; :func:`project_qkv` (projections, optional biases, heads,
optional per-head q/k norm, RoPE); the model's own attention; :func:`attention_output` (optional
softplus gate, ``wo``, optional ``bo``); ``x += that``; :func:`mlp_residual`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.nn.attention import swiglu
from dflash_jax.nn.norms import rms_norm
from dflash_jax.nn.rope import apply_rope


def split_heads(x: jnp.ndarray, n: int, d: int) -> jnp.ndarray:
    """``[..., n*d]`` -> ``[..., n, d]``."""
    return x.reshape(x.shape[:-1] + (n, d))


def project_qkv(lp: dict, h: jnp.ndarray, q_heads: int, kv_heads: int, head_dim: int, positions: jnp.ndarray,
                inv_freq: np.ndarray, eps: float, *, bias: bool = False, qk_norm: bool = False, rope_scale: float = 1.0):
    """Queries, keys and values of the normed layer input ``h [B, T, H]``.

    ``q = h Wq (+ bq)`` split into ``q_heads`` heads of ``head_dim``, ``rms(q; q_norm)`` with
    ``qk_norm``, then RoPE at ``positions [B, T]`` (``inv_freq``, cos/sin times ``rope_scale``);
    ``k`` the same with ``kv_heads``; ``v = h Wv (+ bv)`` in heads, not rotated.

    Returns:
      ``(q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, D])`` in ``h.dtype``.
    """
    q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
    if bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q, k, v = split_heads(q, q_heads, head_dim), split_heads(k, kv_heads, head_dim), split_heads(v, kv_heads, head_dim)
    if qk_norm:
        q, k = rms_norm(q, lp["q_norm"], eps), rms_norm(k, lp["k_norm"], eps)
    return apply_rope(q, positions, inv_freq, rope_scale), apply_rope(k, positions, inv_freq, rope_scale), v


def attention_output(lp: dict, a: jnp.ndarray, h: jnp.ndarray, *, gate: str = "", bias: bool = False) -> jnp.ndarray:
    """The attention block's output ``[B, T, H]`` from per-head attention ``a [B, T, Hq, D]``.

    With ``gate`` ``"head"`` or ``"element"`` (Laguna), ``a`` is first multiplied by
    ``softplus(float32(h Wg))`` cast to ``a.dtype``, one factor per head or per element of the
    concatenated heads (``h [B, T, H]`` the normed layer input); then ``@ wo`` (``+ bo`` with ``bias``).
    """
    b, t, hq, d = a.shape
    if gate:
        g = jax.nn.softplus((h @ lp["wg"]).astype(jnp.float32)).astype(a.dtype)
        a = (a * g[..., None]).reshape(b, t, hq * d) if gate == "head" else a.reshape(b, t, hq * d) * g
    else:
        a = a.reshape(b, t, hq * d)
    a = a @ lp["wo"]
    return a + lp["bo"] if bias else a


def mlp_residual(lp: dict, x: jnp.ndarray, eps: float) -> jnp.ndarray:
    """``x + swiglu(rms(x; mlp_norm))`` with the layer's SwiGLU weights (and ``b_*`` biases, and
    the ``[out, in]`` copies of :mod:`dflash_jax.nn.layouts`, when ``lp`` has them)."""
    h = rms_norm(x, lp["mlp_norm"], eps)
    return x + swiglu(h, lp["w_gate"], lp["w_up"], lp["w_down"], lp.get("b_gate"), lp.get("b_up"), lp.get("b_down"),
                      w_gate_t=lp.get("w_gate_t"), w_up_t=lp.get("w_up_t"))
