"""Attention: the causal, windowed and tree visibility rules, and attention over the live prefix of a
fixed-capacity cache in key blocks (flash-decoding style, :func:`cache_attention`).

A cache of ``capacity`` slots (slot = absolute position) is attended ``key_block`` slots at a
time by a loop whose trip count is traced: ``ceil(n_keys / key_block)`` blocks, where ``n_keys``
is the longest live prefix any query of the batch can see. A step therefore costs what the live
context costs, not what the capacity costs, and one compiled program serves every length (no
recompilation as rows grow). Blocks are combined with an online softmax (running max, running
denominator, rescaled accumulator), float32 throughout.

Source: the online softmax of Milakov & Gimelshein (2018) and FlashAttention (Dao et al. 2022);
the per-block loop over a KV cache of flash-decoding (Dao et al. 2023).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax.numpy as jnp
from jax import lax


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


KEY_BLOCK = 256
"""Cache slots attended per loop iteration: the live prefix is rounded up to a multiple of it.
Measured on XLA:CPU with SmolLM2-135M shapes (BENCHMARKS.md, live-length attention): 256 keeps
the rounding under 2% of a step at every length while the loop's per-block overhead stays small."""


def live_keys(positions: jnp.ndarray, capacity: int) -> jnp.ndarray:
    """The number of cache slots any query of the batch may see: ``max(positions) + 1`` over the
    real positions (those ``< capacity``; padding positions are ``capacity``), at least 1.

    Args:
      positions: ``[B, T]`` int32 absolute query positions.
    Returns:
      int32 scalar in ``[1, capacity]``.
    """
    real = jnp.where(positions < capacity, positions, -1)
    return jnp.clip(jnp.max(real) + 1, 1, capacity).astype(jnp.int32)


FLAT_MAX_QUERIES = 32
"""Blocks of at most this many queries use the flat form (:func:`_scores_flat`), longer ones the
head-batched form (:func:`_scores_batched`): measured on XLA:CPU (BENCHMARKS.md, live-length
attention), the flat form is 4-6x faster than a batched einsum for one query and still ahead at
16, the head-batched form 1.7x ahead of it at 256."""


def _scores_flat(qg, k, v, mask):
    """Logits, then the probabilities-times-values update, as two plain matrix products over the
    key axis: keys ``[B, S, Hkv*D]`` against block-diagonal queries ``[Hkv*D, Hkv*G*T]`` (zeros
    between heads: ``Hkv`` times the multiply-adds, but no transposed copy of the keys and one
    large product instead of ``B*Hkv`` small ones).

    Returns ``(logits, key_axis, pv)``: logits ``[B, S, Hkv, G, T]`` (keys on axis 1, the layout
    of the fast product; keys last was 3-6x slower) and ``pv(p) -> [B, Hkv, G, T, D]``."""
    b, t, hkv, g, d = qg.shape
    s = k.shape[1]
    eye = jnp.eye(hkv, dtype=qg.dtype)
    qbd = jnp.einsum("btkgd,kj->bkdjgt", qg, eye).reshape(b, hkv * d, hkv * g * t)
    lg = jnp.einsum("bsc,bce->bse", k.reshape(b, s, hkv * d), qbd, preferred_element_type=jnp.float32)
    lg = jnp.where(jnp.transpose(mask, (0, 2, 1))[:, :, None, None, :], lg.reshape(b, s, hkv, g, t), -jnp.inf)

    def pv(p):
        o = jnp.einsum("bse,bsc->bec", p.reshape(b, s, hkv * g * t).astype(v.dtype), v.reshape(b, s, hkv * d),
                       preferred_element_type=jnp.float32)
        return jnp.einsum("bjgtkd,jk->bjgtd", o.reshape(b, hkv, g, t, hkv, d), eye.astype(jnp.float32))

    return lg, 1, pv


def _scores_batched(qg, k, v, mask):
    """Logits and the probabilities-times-values update as products batched over ``(B, Hkv)``
    with both batch axes leading (keys copied to ``[B, Hkv, S, D]`` once per block).
    Same contract as :func:`_scores_flat`."""
    b, t, hkv, g, d = qg.shape
    kt, vt = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))
    qt = jnp.transpose(qg, (0, 2, 3, 1, 4))  # [B, Hkv, G, T, D]
    lg = jnp.einsum("bkgtd,bksd->bkgts", qt, kt, preferred_element_type=jnp.float32)
    lg = jnp.where(mask[:, None, None, :, :], lg, -jnp.inf)

    def pv(p):
        return jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), vt, preferred_element_type=jnp.float32)

    return lg, 4, pv


def _absorb(carry, qg, k, v, mask):
    """One online-softmax update of the running max and denominator ``m, l [B, Hkv, G, T]`` and
    the accumulator ``acc [B, Hkv, G, T, D]`` (float32) with keys and values ``[B, S, Hkv, D]``
    under ``mask [B, T, S]``."""
    m, l, acc = carry
    scores = _scores_flat if qg.shape[1] <= FLAT_MAX_QUERIES else _scores_batched
    lg, axis, pv = scores(qg, k, v, mask)
    lg = lg * (qg.shape[-1] ** -0.5)
    m_new = jnp.maximum(m, jnp.max(lg, axis=axis))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    corr = jnp.exp(m - m_safe)  # 0 where m was -inf
    p = jnp.exp(lg - jnp.expand_dims(m_safe, axis))
    return m_new, l * corr + jnp.sum(p, axis=axis), acc * corr[..., None] + pv(p)


def cache_attention(
    q: jnp.ndarray,
    k_all: jnp.ndarray,
    v_all: jnp.ndarray,
    layer,
    n_keys: jnp.ndarray,
    visible: Callable[[jnp.ndarray], jnp.ndarray],
    extra: Sequence = (),
    key_block: int | None = None,
    sinks: jnp.ndarray | None = None,
    pages=None,
) -> jnp.ndarray:
    """Grouped-query attention over the live slots of one layer of a stacked cache, plus optional
    extra key/value parts, under one softmax.

    Args:
      q: ``[B, T, Hq, D]`` queries (rotated, normed); ``Hq`` a multiple of ``Hkv``.
      k_all, v_all: ``[L, B, S, Hkv, D]`` stacked cache (slot = absolute position); or, with
        ``pages``, a paged pool ``[L, N, Hkv, D]``.
      layer: the layer's index into ``k_all`` (Python int or traced int32 scalar).
      n_keys: traced int32 scalar: only slots ``[0, n_keys)`` are read (:func:`live_keys`), in a
        loop of ``key_block`` slots with a traced trip count (not reverse-differentiable); or a
        Python int: slots ``[0, n_keys)`` in one pass (training, where one buffer serves many
        blocks and gradients flow through it).
      visible: ``slots [K] int32 -> [B, T, K] bool``, True where a query may attend that slot.
      extra: ``(k [B, S_i, Hkv, D], v, mask [B, T, S_i] bool)`` parts attended too (a drafter's
        block, a sliding window's ring and new rows).
      key_block: slots per loop iteration (static; capped at ``S``); default :data:`KEY_BLOCK`,
        read when the function is traced (the test suite lowers it to cross block boundaries).
      sinks: optional ``[Hq]`` attention-sink logits (gpt-oss): each head's softmax denominator
        also holds ``exp(sink)`` for a key of zero value (transformers ``modeling_gpt_oss``
        ``eager_attention_forward``); the online softmax starts from it.
      pages: the :class:`~dflash_jax.runtime.carry.PagedKVCache` whose page tables address ``k_all`` and
        ``v_all`` (a cache's ``pages``; ``None`` for a contiguous cache): each key block is
        gathered from the pool (:meth:`~dflash_jax.runtime.carry.PagedKVCache.slot_map`) instead of
        sliced, and ``S`` is the cache's ``capacity``.
    Returns:
      ``[B, T, Hq, D]`` in ``q.dtype``; a query with no visible key returns zeros. Scale
      ``D ** -0.5``, logits and softmax in float32.
    """
    b, t, hq, d = q.shape
    hkv = k_all.shape[-2]
    cap = k_all.shape[2] if pages is None else pages.capacity
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    carry = (jnp.full((b, hkv, g, t), -jnp.inf, jnp.float32), jnp.zeros((b, hkv, g, t), jnp.float32),
             jnp.zeros((b, hkv, g, t, d), jnp.float32))
    if sinks is not None:  # a zero-valued key of logit sink[h]: running max = sink, denominator 1
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(hkv, g)[None, :, :, None], (b, hkv, g, t))
        carry = (m0, jnp.ones((b, hkv, g, t), jnp.float32), carry[2])
    for k, v, mask in extra:
        carry = _absorb(carry, qg, k, v, mask)

    def keys(start, size: int):
        """Keys and values ``[B, size, Hkv, D]`` of positions ``[start, start + size)`` of layer ``layer``."""
        if pages is not None:
            pool = pages.slot_map(start + jnp.arange(size, dtype=jnp.int32))
            return k_all[layer, pool], v_all[layer, pool]
        return (lax.dynamic_slice(k_all, (layer, 0, start, 0, 0), (1, b, size, hkv, d))[0],
                lax.dynamic_slice(v_all, (layer, 0, start, 0, 0), (1, b, size, hkv, d))[0])

    if isinstance(n_keys, int):  # a static span: one pass, no loop (reverse-mode differentiable)
        k, v = keys(0, n_keys)
        return _finish(_absorb(carry, qg, k, v, visible(jnp.arange(n_keys, dtype=jnp.int32))), q)
    blk = min(int(KEY_BLOCK if key_block is None else key_block), cap)
    offsets = jnp.arange(blk, dtype=jnp.int32)

    def body(i, carry):
        first = i * blk
        start = jnp.minimum(first, cap - blk)  # the last block may overlap the one before it
        k, v = keys(start, blk)
        slots = start + offsets
        mask = visible(slots) & ((slots >= first) & (slots < n_keys))[None, None, :]
        return _absorb(carry, qg, k, v, mask)

    n_blocks = (n_keys + blk - 1) // blk
    return _finish(lax.fori_loop(0, n_blocks, body, carry), q)


def _finish(carry, q):
    """``[B, T, Hq, D]`` in ``q.dtype`` from the online-softmax state (zeros where nothing was visible)."""
    _, l, acc = carry
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(q.shape).astype(q.dtype)
