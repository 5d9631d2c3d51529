"""The containers of the decode carry: pytree dataclasses with logical axes per field, KV caches
(contiguous and paged) and the capture buffers, with their writers.

**Pytree dataclasses.** :func:`dataclass` is ``dataclasses.dataclass(frozen=True)`` registered with
:func:`jax.tree_util.register_dataclass`: fields are pytree children (arrays, traced) unless
declared ``field(pytree_node=False)``, which makes them static metadata (hashable: part of a
jitted function's cache key). Instances get ``replace(**changes)``. It is the subset of
``flax.struct`` this package used, on JAX's own API. flax is a dependency (the models as NNX
modules), but ``import flax.struct`` imports ``flax.nnx`` and ``flax.linen`` too, about 0.5 s that
the command line, which never builds a module, would pay on every run (BENCHMARKS.md, "The models
as Flax NNX modules").

**Logical axes.** Every array field of :class:`~dflash_jax.decode.state.DecodeState`, of the caches and of the speculative
extension is declared with :func:`axes_field`, which records one logical axis name (or ``None``)
per dimension next to the field itself. :func:`declared_axes` reads them back as a tree shaped
like the state; :func:`dflash_jax.runtime.sharding.state_axes` (placement) and
:func:`dflash_jax.decode.loop.replace_rows` (continuous batching: every ``"batch"`` axis is swapped)
both use it, so a new per-row field is sharded and swapped as soon as it is declared, and an
undeclared array field is an error rather than a silently skipped one.

**KV caches.** Fixed-capacity pytrees indexed by absolute position: a row's K/V for the token at position ``p`` lives in slot ``p``. The cache holds no length of
its own: the committed slots of row ``b`` are ``[0, DecodeState.length[b] - 1)``, so rolling back a
rejected block is an update of the state's length, never a copy: stale slots beyond it are
overwritten before any query can see them.

**Capture.** Captured target-layer residuals go into a :class:`Capture`, written by every target
model's ``forward_hidden``: inside the layer loop the residual after each layer goes to row ``slot_of[layer]`` of a small
``[n + 1, B, T, H]`` stack (row ``n`` is scratch for layers not captured); after the loop
:func:`write` scatters the listed layers' rows, concatenated in the listed order, into
``capture.hidden`` at ``position - base``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax.errors import DFlashError

__all__ = ["dataclass", "field"]


def field(pytree_node: bool = True, **kwargs):
    """A dataclass field; ``pytree_node=False`` makes it static. ``kwargs`` go to
    :func:`dataclasses.field` (``default``, ``metadata``, ...); the flag is kept in the metadata
    as ``"pytree_node"`` (what :func:`dflash_jax.runtime.carry.declared_axes` reads)."""
    metadata = dict(kwargs.pop("metadata", None) or {}, pytree_node=pytree_node)
    return dataclasses.field(metadata=metadata, **kwargs)


def _replace(self, **changes):
    return dataclasses.replace(self, **changes)


def dataclass(cls):
    """``cls`` as a frozen dataclass and a JAX pytree (module docstring)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data = [f.name for f in fields if f.metadata.get("pytree_node", True)]
    meta = [f.name for f in fields if not f.metadata.get("pytree_node", True)]
    cls.replace = _replace
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)

# Logical axis names of cache arrays (see dflash_jax.runtime.sharding).
KV_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")


def axes_field(*axes: str | None, **kwargs):
    """A pytree dataclass field whose arrays have the logical axes ``axes`` (one per dimension).

    A field holding a container of arrays (a dict or tuple of them) gives every array in it the
    same axes. ``kwargs`` go to :func:`dflash_jax.runtime.carry.field` (e.g. ``default``).
    """
    return field(metadata={"axes": tuple(axes)}, **kwargs)


def declared_axes(tree, where: str = "state"):
    """The logical axes of every array of a pytree dataclass, as a tree of the same structure
    (each array replaced by its tuple of names; ``None`` fields stay ``None``).

    Raises:
      DFlashError: an array field declared without :func:`axes_field`, or whose rank differs
        from its declared axes (the message names the field).
    """
    if tree is None:
        return None
    updates = {}
    for f in dataclasses.fields(tree):
        if not f.metadata.get("pytree_node", True):
            continue
        value, path = getattr(tree, f.name), f"{where}.{f.name}"
        if value is None:
            continue
        if dataclasses.is_dataclass(value):
            updates[f.name] = declared_axes(value, path)
            continue
        if "axes" not in f.metadata:
            raise DFlashError(path, "an array field without declared logical axes", "a field declared with dflash_jax.runtime.carry.axes_field(...)")
        updates[f.name] = jax.tree_util.tree_map(lambda x, ax=f.metadata["axes"], p=path: _checked(ax, x, p), value)
    return tree.replace(**updates)


def _checked(axes: tuple, leaf, path: str) -> tuple:
    if len(axes) != leaf.ndim:
        raise DFlashError(path, f"an array of rank {leaf.ndim} {tuple(leaf.shape)}", f"rank {len(axes)} as its declared axes {axes}")
    return axes


def flat_axes(tree) -> list[tuple]:
    """One axes tuple per array leaf of ``tree``, in ``jax.tree_util`` leaf order."""
    return jax.tree_util.tree_structure(tree).flatten_up_to(declared_axes(tree))

__all__ = ["KV_AXES", "PAGE_SIZE", "Capture", "KVCache", "PagedKVCache", "init_capture", "init_kv_cache", "init_paged_kv_cache", "move_slots",
           "write_layer_rows", "write_rows"]


@dataclass
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
    """Not paged: slots are positions, attention reads contiguous slices (:func:`~dflash_jax.nn.attention.cache_attention`)."""

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


@dataclass
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
    page_size: int = field(pytree_node=False, default=PAGE_SIZE)

    @property
    def capacity(self) -> int:
        return self.table.shape[1] * self.page_size

    @property
    def pages(self) -> "PagedKVCache":
        """The addressing attention reads through (:func:`~dflash_jax.nn.attention.cache_attention`'s ``pages``)."""
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
    ``capacity`` positions (a multiple of ``page_size``), every table entry on the trash page.

    Raises:
      DFlashError: a ``capacity`` that is not a multiple of ``page_size``.
    """
    if capacity % page_size:
        raise DFlashError("capacity", f"{capacity} is not a multiple of the page size {page_size}", f"a multiple of {page_size}")
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


@dataclass
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
    layer_ids: tuple = field(pytree_node=False, default=())
    post_norm_last: bool = field(pytree_node=False, default=False)


def init_capture(layer_ids, batch: int, rows: int, hidden_size: int, dtype, base=None, post_norm_last: bool = False) -> Capture:
    """An empty capture buffer of ``[batch, rows, len(layer_ids) * hidden_size]``."""
    layer_ids = tuple(int(i) for i in layer_ids)
    base = jnp.zeros((batch,), jnp.int32) if base is None else jnp.asarray(base, jnp.int32)
    return Capture(
        hidden=jnp.zeros((batch, rows, len(layer_ids) * hidden_size), dtype), base=base, layer_ids=layer_ids, post_norm_last=post_norm_last
    )


def slots(capture: Capture | None, n_layers: int) -> np.ndarray:
    """``[n_layers]`` int32: the stack row of each layer's residual (``len(layer_ids)`` for layers
    not captured; all zeros without a capture).

    Raises:
      DFlashError: a capture layer id outside ``[0, n_layers)``.
    """
    if capture is None:
        return np.zeros((n_layers,), np.int32)
    n = len(capture.layer_ids)
    out = np.full((n_layers,), n, np.int32)
    for s, i in enumerate(capture.layer_ids):
        if not 0 <= i < n_layers:
            raise DFlashError("capture layer_ids", f"layer id {i} is out of range for a {n_layers}-layer target",
                              f"ids in [0, {n_layers})")
        out[i] = s
    return out


def stack(capture: Capture | None, x: jnp.ndarray) -> jnp.ndarray:
    """The empty residual stack ``[n + 1, B, T, H]`` for hidden ``x [B, T, H]`` (a ``[1, 1, 1, 1]``
    placeholder without a capture)."""
    if capture is None:
        return jnp.zeros((1, 1, 1, 1), x.dtype)
    return jnp.zeros((len(capture.layer_ids) + 1,) + x.shape, x.dtype)


def keep(capture: Capture | None, cap: jnp.ndarray, x: jnp.ndarray, slot) -> jnp.ndarray:
    """``cap`` with a layer's output ``x [B, T, H]`` in row ``slot`` (traced or static int); unchanged
    without a capture."""
    if capture is None:
        return cap
    return lax.dynamic_update_index_in_dim(cap, x, slot, 0)


def write(capture: Capture | None, cap: jnp.ndarray, positions: jnp.ndarray, n_layers: int,
          final_norm: Callable[[jnp.ndarray], jnp.ndarray], valid: jnp.ndarray | None = None) -> Capture | None:
    """The capture with the stacked rows written.

    Args:
      capture: the :class:`Capture` (``None``: returned as is).
      cap: ``[n + 1, B, T, H]`` stack filled by :func:`keep`.
      positions: ``[B, T]`` int32 absolute positions; row ``t`` lands at ``positions - base``
        (rows before ``base`` or past the buffer are dropped).
      n_layers: the target's layer count.
      final_norm: the target's final norm, applied to the last layer's rows when
        ``capture.post_norm_last`` and that layer is captured.
      valid: optional ``[B, T]`` bool; rows where False are not written (padding).
    Returns:
      the capture with ``hidden [B, N, n * H]`` updated.
    """
    if capture is None:
        return None
    cap = cap[:-1]
    if capture.post_norm_last and n_layers - 1 in capture.layer_ids:
        s = capture.layer_ids.index(n_layers - 1)
        cap = cap.at[s].set(final_norm(cap[s]))
    feats = jnp.moveaxis(cap, 0, 2)  # [B, T, n, H]
    feats = feats.reshape(feats.shape[0], feats.shape[1], -1)
    idx = positions - capture.base[:, None]
    drop = idx < 0 if valid is None else (idx < 0) | ~valid
    return capture.replace(hidden=write_rows(capture.hidden, feats, jnp.where(drop, capture.hidden.shape[1], idx)))
