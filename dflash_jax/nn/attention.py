"""Grouped-query attention of a block of queries over a key/value buffer with a boolean mask."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def gqa_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """Softmax attention with grouped K/V heads.

    Args:
      q: ``[B, T, Hq, D]`` queries (already rotated and normed).
      k, v: ``[B, S, Hkv, D]`` keys and values; ``Hq`` is a multiple of ``Hkv``.
      mask: ``[B, T, S]`` bool, True where query t may attend key s. A query row with no
        visible key returns zeros.
    Returns:
      ``[B, T, Hq, D]`` in ``q.dtype``; logits and softmax in float32, scale ``D ** -0.5``.
    """
    return gqa_attention_parts(q, ((k, v, mask),))


def gqa_attention_parts(q: jnp.ndarray, parts) -> jnp.ndarray:
    """Attention over the union of several key/value buffers under one softmax.

    Lets a drafter block attend ``[context cache | block]`` without concatenating the cache.

    Args:
      q: ``[B, T, Hq, D]``.
      parts: sequence of ``(k [B, S_i, Hkv, D], v [B, S_i, Hkv, D], mask [B, T, S_i] bool)``.
    Returns:
      ``[B, T, Hq, D]`` in ``q.dtype``.
    """
    b, t, hq, d = q.shape
    hkv = parts[0][0].shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    logits = []
    for k, _, mask in parts:
        lg = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
        logits.append(jnp.where(mask[:, None, None, :, :], lg, -jnp.inf))
    mx = functools.reduce(jnp.maximum, [jnp.max(lg, axis=-1, keepdims=True) for lg in logits])
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    probs = [jnp.exp(lg - mx) for lg in logits]
    denom = sum(jnp.sum(p, axis=-1, keepdims=True) for p in probs)
    denom = jnp.where(denom > 0, denom, 1.0)
    out = sum(
        jnp.einsum("bkgts,bskd->btkgd", (p / denom).astype(v.dtype), v, preferred_element_type=jnp.float32)
        for p, (_, v, _) in zip(probs, parts)
    )
    return out.reshape(b, t, hq, d).astype(q.dtype)


def causal_mask(q_positions: jnp.ndarray, num_keys: int) -> jnp.ndarray:
    """``[B, T, S]`` mask: key slot ``s`` is visible to a query at position ``p`` iff ``s <= p``.

    Cache slots are indexed by absolute position, so this is the whole causal rule; slots past a
    row's committed length are either written in the same forward or never read.
    """
    return jnp.arange(num_keys, dtype=jnp.int32)[None, None, :] <= q_positions[:, :, None]


def swiglu(x: jnp.ndarray, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None) -> jnp.ndarray:
    """SwiGLU MLP ``down(silu(x @ gate) * (x @ up))``; weights ``[in, out]``, optional biases."""
    g = x @ w_gate
    u = x @ w_up
    if b_gate is not None:
        g, u = g + b_gate, u + b_up
    y = (jax.nn.silu(g) * u) @ w_down
    return y if b_down is None else y + b_down
