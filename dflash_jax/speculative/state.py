"""The speculative extension of the decode state: drafter context K/V and statistics."""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from dflash_jax.axes import KV_AXES, axes_field
from dflash_jax.config import DrafterConfig


@struct.dataclass
class SpeculativeState:
    """Drafter context and acceptance statistics, carried in ``DecodeState.speculative``.

    Context slot ``p`` holds the projected K/V of the committed token at position ``p``; slots
    ``[0, length - 1)`` are valid (the anchor's hidden state is not known before it is verified).
    Only committed rows are ever inside that range: rows written by a verify beyond the accepted
    prefix are masked out and overwritten by the next verify. Tokens committed by verify steps
    are not stored: they are :attr:`dflash_jax.state.DecodeState.committed`.

    Attributes:
      ctx_k, ctx_v: ``[Ld, B, S, Hkv, D]``.
      verify_steps: ``[B]`` int32 verify passes while the row was running.
      drafted: ``[B]`` int32 draft tokens proposed to the target.
      accepted: ``[B]`` int32 draft tokens accepted and kept.
      accepted_per_position: ``[B, n_max]`` int32 steps in which draft position ``i + 1`` was
        accepted and kept.
    """

    ctx_k: jnp.ndarray = axes_field(*KV_AXES)
    ctx_v: jnp.ndarray = axes_field(*KV_AXES)
    verify_steps: jnp.ndarray = axes_field("batch")
    drafted: jnp.ndarray = axes_field("batch")
    accepted: jnp.ndarray = axes_field("batch")
    accepted_per_position: jnp.ndarray = axes_field("batch", None)

    @property
    def n_max(self) -> int:
        return self.accepted_per_position.shape[1]


def init_speculative_state(cfg: DrafterConfig, batch: int, max_len: int, n_max: int) -> SpeculativeState:
    """Empty context of ``max_len`` slots and zeroed statistics for ``n_max`` draft positions."""
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)

    def zeros():  # distinct buffers: the state is donated
        return jnp.zeros((batch,), jnp.int32)

    return SpeculativeState(
        ctx_k=jnp.zeros(shape, cfg.dtype), ctx_v=jnp.zeros(shape, cfg.dtype), verify_steps=zeros(),
        drafted=zeros(), accepted=zeros(), accepted_per_position=jnp.zeros((batch, n_max), jnp.int32),
    )
