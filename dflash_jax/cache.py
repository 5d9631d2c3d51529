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

__all__ = ["KV_AXES", "PAGE_SIZE", "Capture", "KVCache", "PagedKVCache", "init_capture", "init_kv_cache", "init_paged_kv_cache", "move_slots",
           "write_layer_rows", "write_rows"]


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

    pages = None
    """Not paged: slots are positions, attention reads contiguous slices (:func:`~dflash_jax.nn.live_attention.cache_attention`)."""

    def written(self, layer, k: jnp.ndarray, v: jnp.ndarray, positions: jnp.ndarray) -> "KVCache":
        """The cache with ``k, v [B, T, Hkv, D]`` written at ``positions [B, T]`` of layer ``layer``
        (a traced int32 scalar inside a layer scan: the carried stack is updated in place)."""
        return self.replace(k=write_layer_rows(self.k, layer, k, positions), v=write_layer_rows(self.v, layer, v, positions))

    def write_all(self, k: jnp.ndarray, v: jnp.ndarray, positions: jnp.ndarray) -> "KVCache":
        """The cache with ``k, v [L, B, T, Hkv, D]`` written at ``positions [B, T]`` of every layer."""
        b = jnp.arange(self.k.shape[1])[:, None]
        return self.replace(k=self.k.at[:, b, positions].set(k.astype(self.k.dtype), mode="drop"),
                            v=self.v.at[:, b, positions].set(v.astype(self.v.dtype), mode="drop"))

    def moved(self, src: jnp.ndarray, dst: jnp.ndarray) -> "KVCache":
        """The cache with every layer's slot ``src[b, w]`` copied to ``dst[b, w]`` (:func:`move_slots`)."""
        return self.replace(k=move_slots(self.k, src, dst), v=move_slots(self.v, src, dst))


PAGE_SIZE = 16
"""Token positions per page of a :class:`PagedKVCache` (vLLM's default block size): a row's last
page is on average half empty, so smaller pages waste less; the attention gathers slot by slot, so
the page size does not change its cost."""


@pytree.dataclass
class PagedKVCache:
    """Stacked per-layer keys and values in a pool of pages shared by all rows, addressed through
    each row's page table (paged attention: Kwon et al. 2023, vLLM).

    Position ``p`` of row ``b`` lives in pool slot ``table[b, p // page_size] * page_size +
    p % page_size``. Page 0 is the trash page: a row's table entries that own no page point to
    it, so the writes of free rows (and of positions past a row's pages) land there; a live row
    reads it only at positions past its length, which its mask hides. Rollback is the state's
    length, as with :class:`KVCache`.

    Attributes:
      k, v: ``[L, N, Hkv, D]``, ``N = pages * page_size`` pool slots.
      table: ``[B, n]`` int32 page ids per row: the row's capacity is ``n * page_size`` positions.
      page_size: static.
    """

    k: jnp.ndarray = axes_field("layers", None, "kv_heads", "head_dim")
    v: jnp.ndarray = axes_field("layers", None, "kv_heads", "head_dim")
    table: jnp.ndarray = axes_field("batch", None)
    page_size: int = pytree.field(pytree_node=False, default=PAGE_SIZE)

    @property
    def capacity(self) -> int:
        return self.table.shape[1] * self.page_size

    @property
    def pages(self) -> "PagedKVCache":
        """The addressing attention reads through (:func:`~dflash_jax.nn.live_attention.cache_attention`'s ``pages``)."""
        return self

    def slots(self, positions: jnp.ndarray) -> jnp.ndarray:
        """Pool slots ``[B, T]`` int32 of ``positions [B, T]``; positions outside ``[0, capacity)``
        map to ``N`` (past the pool: a write there is dropped, a read clamped)."""
        positions = positions.astype(jnp.int32)
        inside = (positions >= 0) & (positions < self.capacity)
        p = jnp.clip(positions, 0, self.capacity - 1)
        page = jnp.take_along_axis(self.table, p // self.page_size, axis=1)
        return jnp.where(inside, page * self.page_size + p % self.page_size, self.k.shape[1])

    def slot_map(self, slots: jnp.ndarray) -> jnp.ndarray:
        """Pool slots ``[B, K]`` of the positions ``slots [K]`` of every row (attention's reads)."""
        return self.slots(jnp.broadcast_to(slots[None, :], (self.table.shape[0], slots.shape[0])))

    def written(self, layer, k: jnp.ndarray, v: jnp.ndarray, positions: jnp.ndarray) -> "PagedKVCache":
        """The cache with ``k, v [B, T, Hkv, D]`` written at the pool slots of ``positions [B, T]``
        in layer ``layer``; positions past the capacity are dropped."""
        s = self.slots(positions)
        return self.replace(k=self.k.at[layer, s].set(k.astype(self.k.dtype), mode="drop"),
                            v=self.v.at[layer, s].set(v.astype(self.v.dtype), mode="drop"))

    def write_all(self, k: jnp.ndarray, v: jnp.ndarray, positions: jnp.ndarray) -> "PagedKVCache":
        """The cache with ``k, v [L, B, T, Hkv, D]`` written at the pool slots of ``positions [B, T]``."""
        s = self.slots(positions)
        return self.replace(k=self.k.at[:, s].set(k.astype(self.k.dtype), mode="drop"), v=self.v.at[:, s].set(v.astype(self.v.dtype), mode="drop"))

    def moved(self, src: jnp.ndarray, dst: jnp.ndarray) -> "PagedKVCache":
        """The cache with every layer's position ``src[b, w]`` copied to ``dst[b, w]`` (all read first)."""
        s, d = jnp.clip(self.slots(src), 0, self.k.shape[1] - 1), self.slots(dst)
        return self.replace(k=self.k.at[:, d].set(self.k[:, s], mode="drop"), v=self.v.at[:, d].set(self.v[:, s], mode="drop"))


def init_paged_kv_cache(num_layers: int, batch: int, capacity: int, pages: int, kv_heads: int, head_dim: int, dtype,
                        page_size: int = PAGE_SIZE) -> PagedKVCache:
    """An empty paged cache: a pool of ``pages`` pages (page 0 the trash page) and ``batch`` rows of
    ``capacity`` positions (a multiple of ``page_size``), every table entry on the trash page."""
    if capacity % page_size:
        raise ValueError(f"capacity {capacity} is not a multiple of the page size {page_size}")
    shape = (num_layers, pages * page_size, kv_heads, head_dim)
    return PagedKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), table=jnp.zeros((batch, capacity // page_size), jnp.int32),
                        page_size=page_size)


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
