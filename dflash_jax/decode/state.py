"""The decode state: one pytree carrying everything that changes during a generation.

Positions, masks and rollback all derive from ``length``. The target KV cache holds K/V for
positions ``[0, length - 1)``: the last committed token has not been fed to the target yet (it is
the next decode input, or the anchor of the next speculative block).

:class:`SpeculativeState` is its speculative extension (``state.speculative``): the drafter's
context K/V and the statistics of the verify steps.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.decode.sampling import RowSampling
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.runtime import carry as pytree
from dflash_jax.runtime.carry import KVCache, PagedKVCache, axes_field, init_kv_cache

# finish codes, per row
RUNNING, STOP, LENGTH, CAPACITY = 0, 1, 2, 3
FINISH_REASONS = {RUNNING: None, STOP: "stop", LENGTH: "length", CAPACITY: "capacity"}


@pytree.dataclass
class DecodeState:
    """Decode carry for a batch of ``B`` rows with capacity ``S`` tokens each.

    Attributes:
      tokens: ``[B, S]`` int32 prompt then committed tokens.
      length: ``[B]`` int32 tokens committed per row (prompt included).
      prompt_len: ``[B]`` int32.
      max_new: ``[B]`` int32 new-token budget per row.
      stop_ids: ``[B, n]`` int32 ids that end each row (EOS and stop ids; ``-1`` pads).
      cache: target :class:`KVCache`; slots ``[0, length - 1)`` are committed between steps.
      rng: ``[B]`` PRNG keys, one per row, never split: the token at index ``t`` of row ``b`` is
        drawn with the uniform of ``fold_in(rng[b], t)`` (:func:`dflash_jax.decode.sampling.sample_at`).
      sampling: :class:`~dflash_jax.decode.sampling.RowSampling`, each row's temperature, top-k, top-p.
      finish: ``[B]`` int32 finish code (``RUNNING``, ``STOP``, ``LENGTH``, ``CAPACITY``).
      gaps: ``[B, S]`` float32 top-2 logit gap of the target step that chose each token.
      steps: ``[]`` int32 target passes after prefill (decode steps or verify steps).
      speculative: :class:`~dflash_jax.decode.state.SpeculativeState` (drafter context and
        statistics) with a drafter, else ``None``.
    """

    tokens: jnp.ndarray = axes_field("batch", "seq")
    length: jnp.ndarray = axes_field("batch")
    prompt_len: jnp.ndarray = axes_field("batch")
    max_new: jnp.ndarray = axes_field("batch")
    stop_ids: jnp.ndarray = axes_field("batch", None)
    cache: KVCache  # its own fields declare their axes (as speculative's do)
    rng: jax.Array = axes_field("batch")
    sampling: RowSampling  # its own fields declare their axes
    finish: jnp.ndarray = axes_field("batch")
    gaps: jnp.ndarray = axes_field("batch", "seq")
    steps: jnp.ndarray = axes_field()
    speculative: Any = None

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    @property
    def done(self) -> jnp.ndarray:
        """``[B]`` bool: the row has finished (``finish != RUNNING``); a done row never changes again."""
        return self.finish != RUNNING

    @property
    def committed(self) -> jnp.ndarray:
        """``[B]`` int32 tokens committed by the steps after prefill (decode or verify steps, bonus
        tokens included; the first token, chosen by prefill, is not counted)."""
        return jnp.maximum(self.length - self.prompt_len - 1, 0)

    @property
    def new_tokens(self) -> jnp.ndarray:
        """``[B]`` int32 generated tokens per row."""
        return self.length - self.prompt_len


def commit(state: DecodeState, new: jnp.ndarray, n_new: jnp.ndarray, gaps: jnp.ndarray) -> DecodeState:
    """Appends up to ``n_new[b]`` of ``new[b]`` to each running row, stopping exactly at the limits.

    A row keeps tokens up to and including its first stop id, never more than its remaining
    ``max_new`` budget, and never past capacity; done rows are untouched. The finish code records
    which limit ended the row (stop first, then length, then capacity).

    Args:
      state: the decode state.
      new: ``[B, K]`` int32 candidate tokens in order.
      n_new: ``[B]`` int32 how many leading candidates are proposed for commit (``1..K``).
      gaps: ``[B, K]`` float32 top-2 logit gaps of the steps that chose them.
    Returns:
      The state with ``tokens``, ``gaps``, ``length`` and ``finish`` updated.
    """
    b, k = new.shape
    idx = jnp.arange(k, dtype=jnp.int32)[None, :]
    cand = (idx < n_new[:, None]) & ~state.done[:, None]
    is_stop = jnp.any(new[:, :, None] == state.stop_ids[:, None, :], axis=-1) & cand
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), k)
    budget = jnp.minimum(state.max_new - state.new_tokens, state.capacity - state.length)
    keep = cand & (idx <= first_stop[:, None]) & (idx < budget[:, None])
    n_keep = jnp.sum(keep, axis=1).astype(jnp.int32)
    pos = jnp.where(keep, state.length[:, None] + idx, state.capacity)
    rows = jnp.arange(b)[:, None]
    tokens = state.tokens.at[rows, pos].set(new.astype(jnp.int32), mode="drop")
    all_gaps = state.gaps.at[rows, pos].set(gaps.astype(jnp.float32), mode="drop")
    length = state.length + n_keep
    stopped = jnp.any(is_stop & keep, axis=1)
    finish = jnp.where(
        state.done,
        state.finish,
        jnp.where(
            stopped,
            STOP,
            jnp.where(length - state.prompt_len >= state.max_new, LENGTH, jnp.where(length >= state.capacity, CAPACITY, RUNNING)),
        ),
    ).astype(jnp.int32)
    return state.replace(tokens=tokens, gaps=all_gaps, length=length, finish=finish)


@pytree.dataclass
class SpeculativeState:
    """Drafter context and acceptance statistics, carried in ``DecodeState.speculative``.

    Context slot ``p`` holds the projected K/V of the committed token at position ``p``; slots
    ``[0, length - 1)`` are valid (the anchor's hidden state is not known before it is verified).
    Only committed rows are ever inside that range: rows written by a verify beyond the accepted
    prefix are masked out and overwritten by the next verify. Tokens committed by verify steps
    are not stored: they are :attr:`dflash_jax.decode.state.DecodeState.committed`.

    Attributes:
      context: the drafter context K/V, a :class:`~dflash_jax.runtime.carry.KVCache` ``[Ld, B, S, Hkv, D]``
        or, in a paged batch, a :class:`~dflash_jax.runtime.carry.PagedKVCache` addressed by the same page
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
