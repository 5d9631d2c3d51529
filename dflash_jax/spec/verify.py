"""Verify: one target pass over the block, the accept rule, commit, rollback and context update.

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

import jax
import jax.numpy as jnp

from dflash_jax.cache import init_capture
from dflash_jax.config import DrafterConfig
from dflash_jax.registry import module_for
from dflash_jax.sampling import SamplingConfig, probabilities, top2_gap
from dflash_jax.spec.propose import block_positions
from dflash_jax.spec.state import absorb_context
from dflash_jax.state import DecodeState, commit


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


def verify_fn(
    params_t, cfg_t, params_d, cfg_d: DrafterConfig, state: DecodeState, drafts, q, sampling: SamplingConfig, key_accept=None, key_bonus=None
) -> DecodeState:
    """Verifies ``[anchor, drafts]`` with one target pass and commits ``a`` drafts + the bonus.

    Rollback is the length update of the commit (the cache keeps no length); the captured rows of the
    block are projected into the drafter context (only the committed ones are ever visible);
    statistics count only running rows and only kept tokens.

    Args:
      drafts: ``[B, n]`` int32 from propose; ``q``: ``[B, n, V]`` or ``None`` (one-hot).
    Returns:
      The new state.
    """
    mod = module_for(cfg_t)
    b, n = drafts.shape
    width = n + 1
    start, positions, block_len = block_positions(state, width)
    anchor = jnp.take_along_axis(state.tokens, start[:, None], axis=1)
    block = jnp.concatenate([anchor, drafts], axis=1)
    capture = init_capture(cfg_d.target_layer_ids, b, width, cfg_t.hidden_size, cfg_t.dtype, base=start, post_norm_last=cfg_d.post_norm_last)
    hidden, cache, capture = mod.forward_hidden(params_t, cfg_t, block, positions, state.cache, capture)
    logits = mod.lm_head(params_t, cfg_t, hidden)
    n_valid = block_len - 1
    if sampling.greedy:
        a, bonus = accept_greedy(drafts, logits, n_valid)
    else:
        a, bonus = accept_sampled(drafts, logits, q, n_valid, sampling, key_accept, key_bonus)
    k = jnp.arange(width, dtype=jnp.int32)[None, :]
    drafts_pad = jnp.concatenate([drafts, drafts[:, :1]], axis=1)
    new = jnp.where(k < a[:, None], drafts_pad, bonus[:, None])
    running = ~state.done
    before = state.length
    state = commit(state.replace(cache=cache), new, a + 1, top2_gap(logits))
    kept = state.length - before
    spec = absorb_context(params_d, cfg_d, state.spec, capture.hidden, positions)
    acc_kept = jnp.minimum(a, kept)
    pos = jnp.arange(1, n + 1, dtype=jnp.int32)[None, :]
    spec = spec.replace(
        verify_steps=spec.verify_steps + running,
        drafted=spec.drafted + jnp.where(running, n_valid, 0),
        accepted=spec.accepted + acc_kept,
        accepted_per_position=spec.accepted_per_position + (pos <= acc_kept[:, None]),
    )
    return state.replace(spec=spec, steps=state.steps + 1)
