"""The decode state: one pytree carrying everything that changes during a generation.

Positions, masks and rollback all derive from ``length``. The target KV cache holds K/V for
positions ``[0, length - 1)``: the last committed token has not been fed to the target yet (it is
the next decode input, or the anchor of the next speculative block).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax import pytree
from dflash_jax.axes import axes_field
from dflash_jax.cache import KVCache
from dflash_jax.sampling import RowSampling

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
        drawn with the uniform of ``fold_in(rng[b], t)`` (:func:`dflash_jax.sampling.sample_at`).
      sampling: :class:`~dflash_jax.sampling.RowSampling`, each row's temperature, top-k, top-p.
      finish: ``[B]`` int32 finish code (``RUNNING``, ``STOP``, ``LENGTH``, ``CAPACITY``).
      gaps: ``[B, S]`` float32 top-2 logit gap of the target step that chose each token.
      steps: ``[]`` int32 target passes after prefill (decode steps or verify steps).
      speculative: :class:`~dflash_jax.speculative.state.SpeculativeState` (drafter context and
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
