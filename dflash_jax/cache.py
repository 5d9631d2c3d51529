"""KV caches and capture buffers: fixed-capacity pytrees indexed by absolute position.

A row's K/V for the token at position ``p`` lives in slot ``p``. The cache holds no length of
its own: the committed slots of row ``b`` are ``[0, DecodeState.length[b] - 1)``, so rolling back a
rejected block is an update of the state's length, never a copy: stale slots beyond it are
overwritten before any query can see them.
"""

from __future__ import annotations

import jax.numpy as jnp

from dflash_jax import pytree
from dflash_jax.axes import KV_AXES, axes_field

__all__ = ["KV_AXES", "Capture", "KVCache", "init_capture", "init_kv_cache", "move_slots", "write_layer_rows", "write_rows"]


@pytree.dataclass
class KVCache:
    """Stacked per-layer keys and values.

    Attributes:
      k, v: ``[L, B, S, Hkv, D]`` (S = capacity, slot = absolute position).
    """

    k: jnp.ndarray = axes_field(*KV_AXES)
    v: jnp.ndarray = axes_field(*KV_AXES)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


def init_kv_cache(num_layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
    """An empty cache: zeros of ``[num_layers, batch, capacity, kv_heads, head_dim]``."""
    shape = (num_layers, batch, capacity, kv_heads, head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def write_rows(buf: jnp.ndarray, rows: jnp.ndarray, index: jnp.ndarray) -> jnp.ndarray:
    """Scatters ``rows[b, t]`` into ``buf[b, index[b, t]]``; indices outside ``buf`` are dropped.

    Args:
      buf: ``[B, S, ...]``.
      rows: ``[B, T, ...]`` with the trailing shape of ``buf``.
      index: ``[B, T]`` int32 slot per row.
    """
    b = jnp.arange(buf.shape[0])[:, None]
    return buf.at[b, index].set(rows.astype(buf.dtype), mode="drop")


def write_layer_rows(buf: jnp.ndarray, layer, rows: jnp.ndarray, index: jnp.ndarray) -> jnp.ndarray:
    """Scatters ``rows[b, t]`` into ``buf[layer, b, index[b, t]]`` (stacked ``[L, B, S, ...]``
    cache); indices outside the capacity are dropped. ``layer`` is a traced int32 scalar, so the
    scatter updates the carried stack in place inside a layer scan."""
    b = jnp.arange(buf.shape[1])[:, None]
    return buf.at[layer, b, index].set(rows.astype(buf.dtype), mode="drop")


def move_slots(buf: jnp.ndarray, src: jnp.ndarray, dst: jnp.ndarray) -> jnp.ndarray:
    """Copies slot ``src[b, w]`` of every layer of row ``b`` to slot ``dst[b, w]`` (all sources
    read before any write), in a stacked ``[L, B, S, ...]`` cache. Used to compact the accepted
    path of a verified tree to the slots a chain would have used; indices outside ``S`` are
    dropped (a source outside reads clamped, its write is dropped when its ``dst`` is too).

    Args:
      buf: ``[L, B, S, ...]``; src, dst: ``[B, W]`` int32.
    """
    b = jnp.arange(buf.shape[1])[:, None]
    rows = buf[:, b, jnp.clip(src, 0, buf.shape[2] - 1)]
    return buf.at[:, b, dst].set(rows, mode="drop")


@pytree.dataclass
class Capture:
    """Hidden states of chosen target layers, written at ``positions - base`` of each row.

    ``layer_ids`` follow the HF convention: id ``i`` captures ``hidden_states[i + 1]``, the
    residual stream after decoder layer ``i``, before the final norm. Features of the listed
    layers are concatenated along the last axis in the listed order.

    Attributes:
      hidden: ``[B, N, len(layer_ids) * H]`` buffer.
      base: ``[B]`` int32; the token at absolute position ``p`` lands in row ``p - base[b]``
        (rows outside ``[0, N)`` are dropped).
      layer_ids: static tuple of captured decoder-layer ids.
      post_norm_last: static; when the target's last layer is captured, read it after the final
        norm (transformers' ``hidden_states[L]``) instead of the pre-norm residual.
    """

    hidden: jnp.ndarray = axes_field("batch", "seq", None)
    base: jnp.ndarray = axes_field("batch")
    layer_ids: tuple = pytree.field(pytree_node=False, default=())
    post_norm_last: bool = pytree.field(pytree_node=False, default=False)


def init_capture(layer_ids, batch: int, rows: int, hidden_size: int, dtype, base=None, post_norm_last: bool = False) -> Capture:
    """An empty capture buffer of ``[batch, rows, len(layer_ids) * hidden_size]``."""
    layer_ids = tuple(int(i) for i in layer_ids)
    base = jnp.zeros((batch,), jnp.int32) if base is None else jnp.asarray(base, jnp.int32)
    return Capture(
        hidden=jnp.zeros((batch, rows, len(layer_ids) * hidden_size), dtype), base=base, layer_ids=layer_ids, post_norm_last=post_norm_last
    )
