"""Routed experts shared by the MoE families (Laguna, Qwen3-MoE): only the chosen experts run.

The ``N*k`` (token, expert) pairs are sorted by expert and run through ``jax.lax.ragged_dot``
with per-expert group sizes, then scattered back weighted by their routing weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def routed_experts(x: jnp.ndarray, idx: jnp.ndarray, w: jnp.ndarray, e_gate: jnp.ndarray, e_up: jnp.ndarray,
                   e_down: jnp.ndarray) -> jnp.ndarray:
    """``sum_j w[n, j] * expert_{idx[n, j]}(x[n])`` with SwiGLU experts
    ``down(silu(x gate) * (x up))``.

    Args:
      x: ``[N, H]`` tokens.
      idx: ``[N, k]`` int chosen expert ids in ``[0, E)``.
      w: ``[N, k]`` routing weights (cast to ``x.dtype`` by the caller).
      e_gate, e_up: ``[E, H, I]``; e_down: ``[E, I, H]`` (``[in, out]`` per expert).
    Returns:
      ``[N, H]`` in ``x.dtype``. Source: transformers ``Qwen3MoeExperts.forward`` /
      ``LagunaExperts`` (a loop over hit experts), computed here as one sorted ragged matmul.
    """
    k, n_experts = idx.shape[-1], e_gate.shape[0]
    flat_e = idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    tok = order // k
    sizes = jnp.bincount(flat_e, length=n_experts).astype(jnp.int32)
    xs = jnp.take(x, tok, axis=0)
    g = lax.ragged_dot(xs, e_gate, sizes)
    u = lax.ragged_dot(xs, e_up, sizes)
    y = lax.ragged_dot(jax.nn.silu(g) * u, e_down, sizes)
    y = y * jnp.take(w.reshape(-1), order)[:, None]
    return jnp.zeros_like(x).at[tok].add(y.astype(x.dtype))
