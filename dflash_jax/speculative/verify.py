"""Verify: one target pass over the block ``[anchor, drafts]`` and the accept rule.

Accept rule (docs/specs/dflash.md 2.2, "sample and match"): the target chooses its own token at
every slot of the block, the argmax when greedy, else its sample with the uniform of that token's
position (:func:`dflash_jax.sampling.sample_at`); the longest prefix of drafts equal to the
target's tokens is accepted and the target's token after it is the bonus token. Every committed
token is the target's own choice, so greedy output equals the target's greedy decode and sampled
output is exactly the target's sample with the row's key (the same with or without a drafter).
It equals Leviathan/Chen rejection sampling with a one-hot proposal; sampled drafts are coupled
to the target's tokens through the shared uniform instead of a proposal distribution ``q``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from dflash_jax.cache import Capture
from dflash_jax.decoding import Decoding, Params
from dflash_jax.registry import module_for
from dflash_jax.sampling import sample_at, top2_gap
from dflash_jax.speculative.capture import block_capture
from dflash_jax.speculative.propose import block_positions
from dflash_jax.state import DecodeState


def accept(drafts: jnp.ndarray, chosen: jnp.ndarray, n_valid: jnp.ndarray):
    """The accept rule (module docstring).

    Args:
      drafts: ``[B, n]`` int32.
      chosen: ``[B, n + 1]`` int32 the target's token at each slot of ``[anchor, drafts]`` (the
        token that follows that slot).
      n_valid: ``[B]`` int32 drafts that may be accepted (shorter final block).
    Returns:
      ``(a [B] int32 accepted drafts, bonus [B] int32)``.
    """
    ok = (drafts == chosen[:, :-1]) & (jnp.arange(drafts.shape[1])[None, :] < n_valid[:, None])
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    return a, jnp.take_along_axis(chosen, a[:, None], axis=1)[:, 0]


class Verdict(NamedTuple):
    """What the target said about one block, for :func:`dflash_jax.speculative.commit.commit_block`.

    Attributes:
      tokens: ``[B, n + 1]`` int32: the ``accepted`` leading drafts, then the bonus token.
      accepted: ``[B]`` int32 drafts accepted.
      n_valid: ``[B]`` int32 drafts that could be accepted (shorter final block).
      gaps: ``[B, n + 1]`` float32 top-2 logit gaps of the target at each block slot.
      cache: the target cache with the block's K/V written.
      capture: the block's captured target features (base = the anchor's position).
    """

    tokens: jnp.ndarray
    accepted: jnp.ndarray
    n_valid: jnp.ndarray
    gaps: jnp.ndarray
    cache: object
    capture: Capture


def verify_fn(params: Params, state: DecodeState, static: Decoding, drafts) -> Verdict:
    """One target pass over ``[anchor, drafts]`` of each row, then the accept rule (module docstring).

    Args:
      drafts: ``[B, n]`` int32 from propose (``n = 0``: the anchor alone, a plain step that
        keeps the drafter context).
    Returns:
      :class:`Verdict` (the state is read only).
    """
    cfg_t = static.target
    mod = module_for(cfg_t)
    width = drafts.shape[1] + 1
    start, positions, block_len = block_positions(state, width)
    anchor = jnp.take_along_axis(state.tokens, start[:, None], axis=1)
    block = jnp.concatenate([anchor, drafts], axis=1)
    capture = block_capture(static, start, width)
    # a family with recurrent state (models/qwen3_5.py) keeps each block position's state for the
    # commit to choose from; a KV-only family has no such hook (its rollback is the length update)
    cache = state.cache if mod.keep_block_states is None else mod.keep_block_states(cfg_t, state.cache)
    hidden, cache, capture = mod.forward_hidden(params.target, cfg_t, block, positions, cache, capture)
    logits = mod.lm_head(params.target, cfg_t, hidden)
    n_valid = block_len - 1
    a, bonus = accept(drafts, sample_at(state.rng, positions + 1, logits, state.sampling), n_valid)
    k = jnp.arange(width, dtype=jnp.int32)[None, :]
    drafts_pad = jnp.pad(drafts, ((0, 0), (0, 1)))
    tokens = jnp.where(k < a[:, None], drafts_pad, bonus[:, None])
    return Verdict(tokens=tokens, accepted=a, n_valid=n_valid, gaps=top2_gap(logits), cache=cache, capture=capture)
