"""The causal and tree visibility rules and the SwiGLU MLP (attention itself: :mod:`dflash_jax.nn.live_attention`)."""

from __future__ import annotations

import functools
from typing import NamedTuple

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


class TreeBlock(NamedTuple):
    """The shape of a block whose tokens form a tree (tree verification) rather than a chain.

    Token ``t`` of the block is written to slot ``positions[b, 0] + t`` as in a chain, but its
    RoPE position is ``positions[b, 0] + depth[b, t]`` and inside the block it sees only its
    ancestors and itself. A chain is ``depth = t`` with a lower-triangular ``mask``.

    Attributes:
      depth: ``[B, T]`` int32 depth of each token below the block's first (``depth[:, 0] = 0``).
      mask: ``[B, T, T]`` bool, ``mask[b, i, j]``: token ``j`` is token ``i`` or an ancestor of it.
    """

    depth: jnp.ndarray
    mask: jnp.ndarray


def rope_positions(positions: jnp.ndarray, tree: TreeBlock | None) -> jnp.ndarray:
    """``[B, T]`` int32 RoPE positions of a block written at slots ``positions [B, T]``: the
    slots themselves, or with a :class:`TreeBlock` the first slot plus each token's depth."""
    return positions if tree is None else positions[:, :1] + tree.depth


def block_visible(positions: jnp.ndarray, tree: TreeBlock | None):
    """The visibility rule ``slots [K] -> [B, T, K] bool`` of a block written at slots
    ``positions [B, T]`` (contiguous per row): :func:`causal_visible` for a chain; for a
    :class:`TreeBlock`, every slot before the block's first and, inside the block, ``tree.mask``."""
    if tree is None:
        return functools.partial(causal_visible, positions)

    def visible(slots):
        rel = slots[None, :] - positions[:, :1]  # [B, K]
        t = tree.mask.shape[2]
        inside = jnp.take_along_axis(tree.mask, jnp.clip(rel, 0, t - 1)[:, None, :], axis=2)
        return (rel < 0)[:, None, :] | (inside & ((rel >= 0) & (rel < t))[:, None, :])

    return visible


def windowed(visible, positions: jnp.ndarray, rope_pos: jnp.ndarray, window: int, tree: TreeBlock | None):
    """``visible`` (``slots [K] -> [B, T, K] bool``) narrowed to a sliding window: a query sees a
    key only when ``query position - key position < window`` (transformers'
    ``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``; Mistral).

    Args:
      positions: ``[B, T]`` int32 slots of the block; for a chain the slot is the position.
      rope_pos: ``[B, T]`` int32 query positions (:func:`rope_positions`: a tree's depth positions).
      window: static window length (positive).
      tree: with a :class:`TreeBlock`, keys before the block are windowed against ``rope_pos``
        and keys inside it (at most ``T - 1`` positions back) are left to ``tree.mask``; so the
        tree must be shorter than ``window`` (always so for DFlash blocks against real windows).
    """

    def inner(slots):
        near = (rope_pos[:, :, None] - slots[None, None, :]) < window
        if tree is not None:
            near = near | (slots[None, None, :] >= positions[:, :1, None])
        return visible(slots) & near

    return inner


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
