"""Propose: the drafter drafts one block ``[anchor, MASK, ...]`` in a single forward pass."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dflash_jax.decoding import Decoding, Params, check_step_inputs
from dflash_jax.models import drafter
from dflash_jax.sampling import sample_at
from dflash_jax.state import DecodeState


def block_positions(state: DecodeState, width: int):
    """``(start [B], positions [B, W], block_len [B])`` of the next block.

    ``start`` is the anchor's position (the row's last committed token). ``block_len`` shortens
    the final block to the tokens still allowed (budget and capacity), as z-lab's
    ``dflash_generate`` does with ``verify_size``.
    """
    start = state.length - 1
    positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    room = jnp.minimum(state.prompt_len + state.max_new, state.capacity) - start
    return start, positions, jnp.clip(room, 1, width).astype(jnp.int32)


def propose_fn(params: Params, state: DecodeState, static: Decoding):
    """Drafts ``static.depth`` tokens per row (pure; the state is read only).

    ``static.draft_mode`` ``"argmax"`` proposes the drafter's argmax; ``"sample"`` draws each
    draft from the drafter's distribution warped by the row's sampling settings
    (``state.sampling``; a greedy row's draft is the argmax), with the uniform of the draft's
    position, the uniform the target's token there is drawn with (:mod:`dflash_jax.sampling`:
    the two are coupled, what is committed does not change).

    Returns:
      ``(drafts [B, n] int32 target ids, conf [B, n] float32)``: ``conf`` is the top probability
      of the drafter's (unwarped) distribution at each position, a function of the distribution
      only, never of a sampled draft (:mod:`dflash_jax.speculative.depth` chooses the verify
      width from it).
    """
    cfg_t, cfg_d = static.target, static.drafter
    params_d = params.drafter
    lg, positions = draft_logits(params, state, static)
    conf = top_confidence(lg)
    if static.draft_mode == "argmax":
        return drafter.draft_token_ids(params_d, cfg_d, jnp.argmax(lg, axis=-1)), conf
    ids = params_d["draft_ids"] if cfg_d.draft_vocab_size else None  # the target ids of the columns of lg
    # the mask at position p drafts the token at index p: the target draws that token with the same uniform
    return sample_at(state.rng, positions[:, 1:], lg, state.sampling, vocab=cfg_t.vocab_size, ids=ids), conf


def top_confidence(logits: jnp.ndarray) -> jnp.ndarray:
    """The top probability ``[B, n]`` float32 of the drafter's logits ``[B, n, V']`` at each slot."""
    return 1.0 / jnp.sum(jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), axis=-1)


def draft_logits(params: Params, state: DecodeState, static: Decoding):
    """The drafter's one pass over each row's block ``[anchor, MASK x (width - 1)]`` (pure).

    Returns:
      ``(logits [B, width - 1, V'] float32, positions [B, width] int32)``: the drafter's logits at
      each mask slot (``V'``: its draft vocabulary when it has one, else the target's) and the
      block's positions (:func:`block_positions`).
    """
    cfg_t, cfg_d, width = static.target, static.drafter, static.width
    params_d = params.drafter
    start, positions, block_len = block_positions(state, width)
    anchor = jnp.take_along_axis(state.tokens, start[:, None], axis=1)
    block = jnp.concatenate([anchor, jnp.full((anchor.shape[0], width - 1), cfg_d.mask_token_id, jnp.int32)], axis=1)
    ctx = state.speculative
    hidden = drafter.forward(params_d, cfg_d, params.target, cfg_t, block, positions, ctx.ctx_k, ctx.ctx_v, start, block_len,
                             pages=ctx.context.pages)
    return drafter.logits(params_d, cfg_d, params.target, cfg_t, hidden[:, 1:]), positions


@functools.partial(jax.jit, static_argnames=("static",))
def propose_block(params: Params, state: DecodeState, static: Decoding):
    """Jitted :func:`propose_fn`: ``(drafts [B, n] int32, conf [B, n] float32)``.
    Raises DFlashError for arguments that do not go together
    (:func:`~dflash_jax.decoding.check_step_inputs`)."""
    check_step_inputs(params, state, static)
    return propose_fn(params, state, static)
