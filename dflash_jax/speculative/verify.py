"""Verify: one target pass over the block ``[anchor, drafts]`` and the accept rule.

Accept rules (docs/specs/dflash.md 2.2):
- greedy: accept the longest prefix of drafts equal to the target's argmax; the bonus token is
  the argmax after it. Output equals the target's own greedy decode.
- sampling: Leviathan/Chen rejection sampling. Draft ``d_i`` is accepted while
  ``u_i * q_i(d_i) < p_i(d_i)``; after the first rejection the bonus is drawn from
  ``norm(max(0, p - q))`` (or ``p`` if that is empty), after a full accept from ``p`` at the
  last slot. With one-hot ``q`` (argmax proposals) this is exact "sample and match".
  ``p`` and ``q`` are warped by the same temperature/top-k/top-p, so emitted tokens follow the
  target's sampling distribution exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dflash_jax.cache import Capture
from dflash_jax.decoding import Decoding, Params
from dflash_jax.registry import module_for
from dflash_jax.sampling import SamplingConfig, probabilities, top2_gap
from dflash_jax.speculative.capture import block_capture
from dflash_jax.speculative.propose import block_positions
from dflash_jax.state import DecodeState


def accept_greedy(drafts: jnp.ndarray, logits: jnp.ndarray, n_valid: jnp.ndarray):
    """Greedy acceptance.

    Args:
      drafts: ``[B, n]`` int32.
      logits: ``[B, n + 1, V]`` target logits over ``[anchor, drafts]``.
      n_valid: ``[B]`` int32 drafts that may be accepted (shorter final block).
    Returns:
      ``(a [B] int32 accepted drafts, bonus [B] int32)``.
    """
    post = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    ok = (drafts == post[:, :-1]) & (jnp.arange(drafts.shape[1])[None, :] < n_valid[:, None])
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    return a, jnp.take_along_axis(post, a[:, None], axis=1)[:, 0]


def accept_sampled(drafts, logits, q, n_valid, sampling: SamplingConfig, key_accept, key_bonus):
    """Exact rejection sampling (module docstring).

    Args:
      drafts: ``[B, n]`` int32; logits ``[B, n + 1, V]``; ``q``: ``[B, n, V]`` proposal
        probabilities or ``None`` for one-hot (argmax) proposals.
    Returns:
      ``(a [B] int32, bonus [B] int32)``.
    """
    b, n = drafts.shape
    p = probabilities(logits, sampling)  # [B, n+1, V]
    p_d = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    if q is None:
        q = jax.nn.one_hot(drafts, p.shape[-1], dtype=jnp.float32)
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(key_accept, (b, n))
    ok = (u * q_d < p_d) & (jnp.arange(n)[None, :] < n_valid[:, None])
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    q_a = jnp.take_along_axis(q_pad, a[:, None, None], axis=1)[:, 0]
    rejected = (a < n_valid)[:, None]
    resid = jnp.where(rejected, jnp.maximum(p_a - q_a, 0.0), p_a)
    total = jnp.sum(resid, axis=-1, keepdims=True)
    dist = jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), p_a)
    bonus = jax.random.categorical(key_bonus, jnp.log(dist), axis=-1).astype(jnp.int32)
    return a, bonus


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


def verify_fn(params: Params, state: DecodeState, static: Decoding, drafts, q=None, key_accept=None, key_bonus=None) -> Verdict:
    """One target pass over ``[anchor, drafts]`` of each row, then the accept rule (module docstring).

    Args:
      drafts: ``[B, n]`` int32 from propose (``n = 0``: the anchor alone, a plain step that
        keeps the drafter context); ``q``: ``[B, n, V]`` proposal probabilities or
        ``None`` (one-hot); ``key_accept``, ``key_bonus``: PRNG keys when sampling.
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
    hidden, cache, capture = mod.forward_hidden(params.target, cfg_t, block, positions, state.cache, capture)
    logits = mod.lm_head(params.target, cfg_t, hidden)
    n_valid = block_len - 1
    if static.sampling.greedy:
        a, bonus = accept_greedy(drafts, logits, n_valid)
    else:
        a, bonus = accept_sampled(drafts, logits, q, n_valid, static.sampling, key_accept, key_bonus)
    k = jnp.arange(width, dtype=jnp.int32)[None, :]
    drafts_pad = jnp.pad(drafts, ((0, 0), (0, 1)))
    tokens = jnp.where(k < a[:, None], drafts_pad, bonus[:, None])
    return Verdict(tokens=tokens, accepted=a, n_valid=n_valid, gaps=top2_gap(logits), cache=cache, capture=capture)
