"""The speculative extension of the decode state: drafter context K/V and statistics."""

from __future__ import annotations

import jax.numpy as jnp

from dflash_jax import pytree
from dflash_jax.axes import axes_field
from dflash_jax.cache import KVCache, PagedKVCache, init_kv_cache
from dflash_jax.config import DrafterConfig


@pytree.dataclass
class SpeculativeState:
    """Drafter context and acceptance statistics, carried in ``DecodeState.speculative``.

    Context slot ``p`` holds the projected K/V of the committed token at position ``p``; slots
    ``[0, length - 1)`` are valid (the anchor's hidden state is not known before it is verified).
    Only committed rows are ever inside that range: rows written by a verify beyond the accepted
    prefix are masked out and overwritten by the next verify. Tokens committed by verify steps
    are not stored: they are :attr:`dflash_jax.state.DecodeState.committed`.

    Attributes:
      context: the drafter context K/V, a :class:`~dflash_jax.cache.KVCache` ``[Ld, B, S, Hkv, D]``
        or, in a paged batch, a :class:`~dflash_jax.cache.PagedKVCache` addressed by the same page
        tables as the target cache (:attr:`ctx_k` / :attr:`ctx_v` read its arrays).
      verify_steps: ``[B]`` int32 target passes while the row was running (the plain steps of
        ``n_max="auto"`` included: a verify of the anchor alone).
      drafted: ``[B]`` int32 draft tokens proposed to the target.
      accepted: ``[B]`` int32 draft tokens accepted and kept.
      accepted_per_position: ``[B, n]`` int32 steps in which draft position ``i + 1`` was
        accepted and kept (``n``: the drafted depth, ``Decoding.depth``).
      widths: ``[m + 1]`` int32 batch steps that proposed and verified ``w`` drafts (a tree's
        nodes under ``tree=``), ``w = 0..m`` (``m``: ``Decoding.verify_top``; with a fixed
        ``n_max`` every step counts at ``m``; the other steps of ``DecodeState.steps`` are plain
        steps).
      plain_left: ``[]`` int32 plain steps to take before the next propose (``auto``).
      backoff: ``[]`` int32 plain steps that the next propose that does not pay schedules (``auto``).
    """

    context: KVCache | PagedKVCache  # its own fields declare their axes
    verify_steps: jnp.ndarray = axes_field("batch")
    drafted: jnp.ndarray = axes_field("batch")
    accepted: jnp.ndarray = axes_field("batch")
    accepted_per_position: jnp.ndarray = axes_field("batch", None)
    widths: jnp.ndarray = axes_field(None)
    plain_left: jnp.ndarray = axes_field()
    backoff: jnp.ndarray = axes_field()

    @property
    def ctx_k(self) -> jnp.ndarray:
        return self.context.k

    @property
    def ctx_v(self) -> jnp.ndarray:
        return self.context.v

    @property
    def n_max(self) -> int:
        """Draft positions tracked: the drafted depth."""
        return self.accepted_per_position.shape[1]


def init_speculative_state(cfg: DrafterConfig, batch: int, max_len: int, n_max: int, top: int | None = None) -> SpeculativeState:
    """Empty context of ``max_len`` slots and zeroed statistics for ``n_max`` draft positions and
    verifies of up to ``top`` drafts (a tree's nodes; ``None``: ``n_max``)."""
    def zeros():  # distinct buffers: the state is donated
        return jnp.zeros((batch,), jnp.int32)

    return SpeculativeState(
        context=init_kv_cache(cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim, cfg.dtype), verify_steps=zeros(),
        drafted=zeros(), accepted=zeros(), accepted_per_position=jnp.zeros((batch, n_max), jnp.int32),
        widths=jnp.zeros(((top or n_max) + 1,), jnp.int32), plain_left=jnp.zeros((), jnp.int32),
        backoff=jnp.ones((), jnp.int32),
    )
