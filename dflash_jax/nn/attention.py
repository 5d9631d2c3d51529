"""The causal visibility rule and the SwiGLU MLP (attention itself: :mod:`dflash_jax.nn.live_attention`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.nn import layouts


def causal_visible(q_positions: jnp.ndarray, slots: jnp.ndarray) -> jnp.ndarray:
    """``[B, T, K]`` mask: key slot ``slots[k]`` is visible to a query at position ``p`` iff
    ``slot <= p`` (``q_positions [B, T]``, ``slots [K]`` int32).

    Cache slots are indexed by absolute position, so this is the whole causal rule; slots past a
    row's committed length are either written in the same forward or never read.
    """
    return slots[None, None, :] <= q_positions[:, :, None]


def swiglu(x: jnp.ndarray, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, *, w_gate_t=None,
           w_up_t=None) -> jnp.ndarray:
    """SwiGLU MLP ``down(silu(x @ gate) * (x @ up))``; weights ``[in, out]``, optional biases;
    ``w_gate_t``/``w_up_t``: optional ``[out, in]`` copies for wide passes
    (:mod:`dflash_jax.nn.layouts`)."""
    g = layouts.project(x, w_gate, w_gate_t, layouts.GATE_UP_MIN_ROWS)
    u = layouts.project(x, w_up, w_up_t, layouts.GATE_UP_MIN_ROWS)
    if b_gate is not None:
        g, u = g + b_gate, u + b_up
    y = (jax.nn.silu(g) * u) @ w_down
    return y if b_down is None else y + b_down
